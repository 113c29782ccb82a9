"""A sandboxed child that has read the source tries to get out of `egressd sandbox`.

Each test is one way out, of the classes a child that has read the source tries: descriptors
it inherits, the launcher's pipes, egressd's own code, policy, audit and CA, the user's credentials,
start-up files, other sandboxes' sockets, the host's loopback. Every test goes through the real
command with real bubblewrap, and fails if the way out is open.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.answers import assert_refusal, parse_http
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, write_policy
from tests.support.netns import UPSTREAM_V4
from tests.support.npm_registry import NpmRegistry
from tests.support.sandboxes import BWRAP, egressd_sandbox, python_inside, sandbox_env
from tests.support.upstreams import EchoHTTPServer

# -- what crosses into the sandbox ------------------------------------------------------------------
WRITE_THROUGH_FDS = """
    import json, os
    wrote = []
    for name in os.listdir("/proc/self/fd"):
        try:
            with open(f"/proc/self/fd/{name}/planted", "w") as f:
                f.write("x")
            wrote.append(name)
        except OSError:
            pass
    print(json.dumps(wrote))
"""


def test_an_inherited_directory_descriptor_does_not_reach_the_child(tmp_path: Path, work: Path) -> None:
    outside = tmp_path / "outside"  # read-only in the sandbox (not the working directory)
    outside.mkdir()
    fd = os.open(outside, os.O_RDONLY | os.O_DIRECTORY)
    try:
        result = subprocess.run(
            [*EGRESSD, "sandbox", "--", *python_inside(WRITE_THROUGH_FDS)],
            cwd=work,
            env=sandbox_env(work),
            capture_output=True,
            timeout=60,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    assert not (outside / "planted").exists()


def test_a_directory_as_stdin_is_refused(tmp_path: Path, work: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    directory = os.open(outside, os.O_RDONLY | os.O_DIRECTORY)  # as a shell's `cmd < dir` does
    try:
        result = subprocess.run(
            [*EGRESSD, "sandbox", "--", "touch", "ran"],
            cwd=work,
            env=sandbox_env(work),
            stdin=directory,
            capture_output=True,
            timeout=60,
        )
    finally:
        os.close(directory)
    assert result.returncode != 0
    assert not (work / "ran").exists()


FORGE_STATUS = """
    import os
    reached = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            if int(fd) <= 2:  # stdio the child shares anyway (bubblewrap's init holds the same)
                continue
            try:
                with open(f"/proc/{pid}/fd/{fd}", "w") as pipe:
                    pipe.write("error forged by the child\\nexit 0\\n")
                reached.append(f"{pid}/{fd}")
            except OSError:
                pass
    print(reached)
    raise SystemExit(7)
"""


def test_the_child_cannot_forge_the_launchers_status(work: Path) -> None:
    result = egressd_sandbox([], python_inside(FORGE_STATUS), cwd=work)
    assert b"forged" not in result.stderr
    assert result.returncode == 7, result.stderr
    assert result.stdout.strip() == b"[]"


# -- what egressd reads, runs and writes ---------------------------------------------------------
def _egressd_copy_in(directory: Path) -> Path:
    """egressd's package (with its addons) copied into `directory`, as an editable install or a
    project `.venv` puts it under the working directory; returns the copy's import root."""
    import egressd

    root = directory / "src"
    package = Path(egressd.__file__).parent
    shutil.copytree(package, root / "egressd", ignore=shutil.ignore_patterns("__pycache__"))
    addons = Path(importlib.util.find_spec("egressd.addons").submodule_search_locations[0])  # type: ignore[union-attr,index]
    shutil.rmtree(root / "egressd" / "addons", ignore_errors=True)
    shutil.copytree(addons, root / "egressd" / "addons", ignore=shutil.ignore_patterns("__pycache__"))
    return root


# The child's way of recording each try: "DONE", or the error it got.
ATTEMPT = """
    tried = {}
    def attempt(name, action):
        try:
            action()
            tried[name] = "DONE"
        except OSError as exc:
            tried[name] = exc.strerror
"""

PLANT_IN_EGRESSD = """
    import json, os, socket, struct, sys
    root, marker = sys.argv[1], sys.argv[2]
    def append():
        with open(os.path.join(root, "egressd", "addons", "tunnel_guard.py"), "a") as f:
            f.write(f"\\nopen({marker!r}, 'w').write('ran outside')\\n")
    attempt("append_addon", append)
    attempt("new_module", lambda: open(os.path.join(root, "egressd", "planted.py"), "w").close())
    attempt("rename_root", lambda: os.rename(root, root + ".moved"))
    attempt("rename_package", lambda: os.rename(os.path.join(root, "egressd"), os.path.join(root, "x")))
"""

# The child opens a tunnel the policy inspects (INSPECTING): egressd starts mitmproxy and imports its
# addons only then, after the child had its chance to plant code.
TARGET = f"{UPSTREAM_V4[0]}:9"  # nothing listens there: mitmproxy starts all the same
INSPECTING = f"version: 1\nallow: ['{TARGET}']\ninspect: ['{TARGET}']\n"
START_MITMPROXY = """
    import base64
    from urllib.parse import urlsplit
    proxy = urlsplit(os.environ["HTTP_PROXY"])
    secret = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
    head = f"CONNECT TARGET HTTP/1.1\\r\\nProxy-Authorization: Basic {secret}\\r\\n\\r\\n"
    # egressd then starts mitmproxy, compiling it from source where its bytecode cache is read-only:
    # tens of seconds on a busy machine
    with socket.create_connection((proxy.hostname, proxy.port), timeout=60) as s:
        s.sendall(head.encode())
        sys.stderr.write(f"answer {s.recv(12)!r}\\n")
    print(json.dumps(tried))
""".replace("TARGET", TARGET)


@pytest.mark.timeout(240)
def test_egressd_code_in_the_working_directory_is_read_only(tmp_path: Path, work: Path) -> None:
    root = _egressd_copy_in(work)
    marker = tmp_path / "ran-outside"
    env = sandbox_env(work)
    env["PYTHONPATH"] = str(root)  # egressd runs from the copy in the working directory
    policy = write_policy(tmp_path, INSPECTING)
    result = egressd_sandbox(
        ["--policy", str(policy)],
        [*python_inside(ATTEMPT + PLANT_IN_EGRESSD + START_MITMPROXY), str(root), str(marker)],
        cwd=work,
        env=env,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr
    tried = json.loads(result.stdout)
    assert tried == {
        "append_addon": "Read-only file system",
        "new_module": "Read-only file system",
        "rename_root": "Device or resource busy",
        "rename_package": "Read-only file system",
    }
    assert not marker.exists()
    assert "ran outside" not in (root / "egressd" / "addons" / "tunnel_guard.py").read_text()


PLANT_PRESETS = """
    import json, os, sys
    for path in sys.argv[1:]:
        def replace(path=path):
            with open(path, "w") as f:
                f.write("version: 1\\nmode: allow\\n")
        attempt(os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path), replace)
    print(json.dumps(tried))
"""


def _egressd_in_a_project_venv(work: Path) -> tuple[Path, Path]:
    """egressd installed in the project's own `.venv` (its dependencies from this one's site-packages):
    (that venv's python, the package's presets directory)."""
    import sysconfig

    venv = work / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    shutil.move(str(_egressd_copy_in(work / "copy") / "egressd"), str(site / "egressd"))
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv / "bin" / "python", site / "egressd" / "data" / "policies"


def _egressd_checkout_in(work: Path) -> Path:
    """A checkout of egressd in the project (its presets in `policies/`, which the package's
    `data/policies` links to), run through PYTHONPATH; returns the presets directory."""
    import egressd

    root = _egressd_copy_in(work)
    repo = Path(egressd.__file__).parent.parent
    shutil.rmtree(root / "egressd" / "data" / "policies")
    (root / "egressd" / "data" / "policies").symlink_to(Path("..", "..", "policies"))
    shutil.copytree(repo / "policies", root / "policies")
    (root / "pyproject.toml").write_text('[project]\nname = "egressd"\n')
    return root / "policies"


@pytest.mark.parametrize("layout", ["project .venv", "checkout"])
def test_a_preset_pin_leaves_every_other_preset_read_only(layout: str, work: Path) -> None:
    """`--policy npm` pins npm.yaml read-only; the directories on the way to it must not become
    writable binds over the read-only package (or venv, or checkout), where the child would turn
    github.yaml into `mode: allow` for every later `--policy github` run."""
    env = sandbox_env(work)
    if layout == "checkout":
        presets = _egressd_checkout_in(work)
        env["PYTHONPATH"] = str(presets.parent)
        egressd = EGRESSD
    else:
        python, presets = _egressd_in_a_project_venv(work)
        egressd = [str(python), "-m", "egressd"]
    originals = {p.name: p.read_text() for p in presets.glob("*.yaml")}
    targets = [presets / "github.yaml", presets / "npm.yaml", presets / "new.yaml"]
    if layout == "project .venv":
        lib = python.parent.parent / "lib"
        targets += [lib / "planted.py", next(lib.iterdir()) / "planted.py"]
    result = subprocess.run(
        [
            *egressd,
            "sandbox",
            "--policy",
            "npm",
            "--",
            *python_inside(ATTEMPT + PLANT_PRESETS),
            *map(str, targets),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    tried = json.loads(result.stdout)
    assert set(tried.values()) == {"Read-only file system"}, tried
    assert {p.name: p.read_text() for p in presets.glob("*.yaml")} == originals
    assert not any(t.exists() for t in targets if t.name in ("new.yaml", "planted.py"))


PLANT_BYTECODE = """
    import importlib._bootstrap_external as bootstrap, json, os, socket, sys
    prefix, source, marker = sys.argv[1:4]
    def plant():
        info = os.stat(source)
        text = open(source).read() + f"\\nopen({marker!r}, 'w').write('ran outside')\\n"
        data = bootstrap._code_to_timestamp_pyc(compile(text, source, "exec"), info.st_mtime, info.st_size)
        name = os.path.basename(source)[:-3] + f".{sys.implementation.cache_tag}.pyc"
        target = os.path.join(prefix + os.path.dirname(source), name)  # where egressd looks first
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
    attempt("plant", plant)
"""


@pytest.mark.timeout(240)
def test_a_bytecode_cache_prefix_in_the_working_directory_is_read_only(tmp_path: Path, work: Path) -> None:
    """PYTHONPYCACHEPREFIX: egressd loads the bytecode of a module it imports late (its addons,
    mitmproxy) from there, not from beside the read-only source."""
    marker = tmp_path / "ran-outside"
    source = importlib.util.find_spec("egressd.addons.tunnel_guard").origin  # type: ignore[union-attr]
    env = sandbox_env(work)
    env["PYTHONPYCACHEPREFIX"] = str(work / ".pycache")
    policy = write_policy(tmp_path, INSPECTING)
    result = egressd_sandbox(
        ["--policy", str(policy)],
        [
            *python_inside(ATTEMPT + PLANT_BYTECODE + START_MITMPROXY),
            str(work / ".pycache"),
            str(source),
            str(marker),
        ],
        cwd=work,
        env=env,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"plant": "Read-only file system"}
    assert not marker.exists()


def test_a_working_directory_inside_egressd_code_is_refused(work: Path) -> None:
    root = _egressd_copy_in(work)
    env = sandbox_env(work)
    env["PYTHONPATH"] = str(root)
    inside = root / "egressd" / "sandbox"
    result = egressd_sandbox([], ["touch", "planted"], cwd=inside, env=env)
    assert result.returncode == 2
    assert b"egressd's own package" in result.stderr and b"must never change" in result.stderr
    assert not (inside / "planted").exists()


TAMPER = """
    import json, os, sys, time, urllib.error, urllib.request
    policy, audit, url = sys.argv[1:4]
    attempt("rewrite_policy", lambda: open(policy, "w").write("version: 1\\nmode: allow\\n"))
    def replace_policy():
        with open("new.yaml", "w") as f:
            f.write("version: 1\\nmode: allow\\n")
        os.replace("new.yaml", policy)
    attempt("replace_policy", replace_policy)
    conf = os.path.dirname(policy)
    attempt("move_policy_dir", lambda: os.rename(conf, conf + ".old"))
    attempt("empty_audit", lambda: open(audit, "w").close())
    attempt("forge_audit", lambda: open(audit, "a").write('{"forged": true}\\n'))
    time.sleep(1.5)  # a reload would have happened by now
    try:
        urllib.request.urlopen(url, timeout=20)
        tried["request"] = 200
    except urllib.error.HTTPError as exc:
        tried["request"] = exc.code
    print(json.dumps(tried))
"""


def test_the_policy_and_audit_in_the_working_directory_cannot_be_changed(work: Path) -> None:
    conf = work / "conf"
    conf.mkdir()
    policy = conf / "agent.yaml"
    policy.write_text("version: 1\nmode: enforce\nallow: [up.test]\n")
    original = policy.read_text()
    audit = work / "audit.jsonl"
    result = egressd_sandbox(
        ["--policy", "conf/agent.yaml", "--audit", "audit.jsonl"],
        [*python_inside(ATTEMPT + TAMPER), str(policy), str(audit), "http://elsewhere.test/"],
        cwd=work,
    )
    assert result.returncode == 0, result.stderr
    tried = json.loads(result.stdout)
    assert tried.pop("replace_policy") in ("Device or resource busy", "Invalid cross-device link")
    assert tried == {
        "rewrite_policy": "Read-only file system",
        "move_policy_dir": "Device or resource busy",
        "empty_audit": "Read-only file system",
        "forge_audit": "Read-only file system",
        "request": 403,
    }
    assert policy.read_text() == original
    records = audit_records(audit)
    assert not any(r.get("forged") for r in records)
    assert any(r.get("host") == "elsewhere.test" and r.get("reason") == "not_allowlisted" for r in records)


SWAP_UNDER_A_READ_ONLY_MOUNT = """
    import json, os, sys, time, urllib.error, urllib.request
    policy, url = sys.argv[1:3]
    shown = os.path.dirname(policy)  # the user's --ro directory, itself inside a plain one
    outer = os.path.dirname(shown)
    def swap():
        os.rename(outer, outer + ".old")  # the read-only mount moves along
        os.makedirs(shown)
        with open(policy, "w") as f:  # the host path of the policy is now the child's file
            f.write("version: 1\\nmode: allow\\n")
    attempt("swap", swap)
    deadline = time.monotonic() + (15 if tried["swap"] == "DONE" else 0)
    while True:  # until the reload (polled every 0.5 s) took the child's file, if it can
        try:
            urllib.request.urlopen(url, timeout=20)
            tried["request"] = 200
        except urllib.error.HTTPError as exc:
            tried["request"] = exc.headers.get("X-Egressd-Reason")
        if tried["request"] != "not_allowlisted" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print(json.dumps(tried))
"""


def test_a_policy_under_a_nested_read_only_mount_cannot_be_swapped(work: Path) -> None:
    shown = work / "cfg" / "egressd"
    shown.mkdir(parents=True)
    policy = shown / "agent.yaml"
    policy.write_text("version: 1\nmode: enforce\nallow: [up.test]\n")
    original = policy.read_text()
    result = egressd_sandbox(
        ["--ro", "cfg/egressd", "--policy", "cfg/egressd/agent.yaml"],
        [*python_inside(ATTEMPT + SWAP_UNDER_A_READ_ONLY_MOUNT), str(policy), "http://elsewhere.test/"],
        cwd=work,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"swap": "Device or resource busy", "request": "not_allowlisted"}
    assert policy.read_text() == original


WRITE_THROUGH_A_LINK = """
    import json, os, sys
    try:
        os.link(sys.argv[1], "fresh")  # a new link across the read-only bind: never possible
        tried = {"new_link": "DONE"}
    except OSError as exc:
        tried = {"new_link": exc.strerror}
    with open(".planted", "w") as f:  # an old one: the policy's own inode
        f.write("version: 1\\nmode: allow\\n")
    print(json.dumps(tried))
"""


@pytest.mark.parametrize("option", ["--policy", "--audit"])
def test_a_hard_link_to_the_policy_or_audit_in_a_writable_directory_is_refused(
    option: str, work: Path
) -> None:
    conf = work / "conf"
    conf.mkdir()
    target = conf / "agent.yaml"
    target.write_text("version: 1\nmode: enforce\nallow: [up.test]\n")
    original = target.read_text()
    os.link(target, work / ".planted")  # left by an earlier child, when the file was not guarded
    result = egressd_sandbox(
        [option, "conf/agent.yaml"], [*python_inside(WRITE_THROUGH_A_LINK), str(target)], cwd=work
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert b"hard link" in result.stderr
    assert target.read_text() == original


def test_an_audit_path_a_child_made_a_symlink_is_refused(tmp_path: Path, work: Path) -> None:
    """An earlier child (no --audit then) leaves `audit.jsonl -> ~/.bashrc`; egressd must not follow
    it and append records whose paths the child chose (`$(...)` runs when bash reads the line)."""
    bashrc = tmp_path / "home" / ".bashrc"
    bashrc.parent.mkdir()
    bashrc.write_text("export A=1\n")
    plant = ["ln", "-s", str(bashrc), "audit.jsonl"]
    assert egressd_sandbox([], plant, cwd=work).returncode == 0
    url = "http://elsewhere.test/$(touch${IFS}pwned)"
    later = egressd_sandbox(
        ["--audit", "audit.jsonl"], ["curl", "-sS", "-g", "--max-time", "20", url], cwd=work
    )
    assert bashrc.read_text() == "export A=1\n"
    assert later.returncode == 2, later.stderr
    assert b"symlink" in later.stderr and b"audit.jsonl" in later.stderr


def test_a_rw_path_a_child_made_a_symlink_is_refused(tmp_path: Path, work: Path) -> None:
    """An earlier child leaves `build -> ~/.config/autostart`; `--ro . --rw build` must not make
    the directory the child chose writable."""
    victim = tmp_path / "autostart"
    victim.mkdir()
    assert egressd_sandbox([], ["ln", "-s", str(victim), "build"], cwd=work).returncode == 0
    later = egressd_sandbox(["--ro", ".", "--rw", "build"], ["touch", "build/planted"], cwd=work)
    assert list(victim.iterdir()) == []
    assert later.returncode == 2, later.stderr
    assert b"symlink" in later.stderr and b"--rw build" in later.stderr


def test_a_file_named_like_a_preset_does_not_replace_the_preset(work: Path) -> None:
    """`egressd sandbox --policy npm -- npm ci`: an earlier child (a postinstall script) leaves a
    file `npm` in the working directory; the next run must not take its policy for the preset."""
    plant = ["sh", "-c", "printf 'version: 1\\nmode: allow\\n' > npm"]
    assert egressd_sandbox(["--policy", "npm"], plant, cwd=work).returncode == 0
    assert (work / "npm").read_text() == "version: 1\nmode: allow\n"
    later = egressd_sandbox(
        ["--policy", "npm"], ["curl", "-sS", "-i", "--max-time", "20", "http://x.test/"], cwd=work
    )
    assert b"mode: allow" not in later.stdout
    assert later.returncode == 2, later.stdout
    assert b"./npm" in later.stderr and b"preset" in later.stderr


def test_a_bwrap_the_child_put_on_path_is_never_run(tmp_path: Path, work: Path) -> None:
    """PATH often leads into the project (an activated .venv/bin, direnv's node_modules/.bin, ./bin):
    an earlier child (a package's console script named `bwrap`) must not get run, unconfined, by
    the next `egressd sandbox`."""
    marker = tmp_path / "ran-outside"
    fake = f'#!/bin/sh\necho unconfined > {marker}\nexec {BWRAP} "$@"\n'
    write = "import os, sys; os.mkdir('bin'); open('bin/bwrap', 'w').write(sys.argv[1])"
    write += "; os.chmod('bin/bwrap', 0o755)"
    plant = [*python_inside(write), fake]
    assert egressd_sandbox([], plant, cwd=work).returncode == 0
    assert (work / "bin" / "bwrap").exists()
    env = sandbox_env(work)
    env["PATH"] = f"{work / 'bin'}:{env['PATH']}"
    later = egressd_sandbox([], ["true"], cwd=work, env=env)
    assert not marker.exists()
    assert later.returncode == 2, later.stderr
    assert str(work / "bin" / "bwrap").encode() in later.stderr


def test_capture_tools_the_child_put_on_path_are_never_run(tmp_path: Path, work: Path) -> None:
    """nft, ip and nsenter run outside the sandbox (in its network namespace): a copy an earlier
    child left on a PATH that leads into the project is never the one run."""
    marker = tmp_path / "ran-outside"
    write = "import os, sys\nos.mkdir('bin')\nfor name in ('nft', 'ip', 'nsenter'):\n"
    write += "    open('bin/' + name, 'w').write(sys.argv[1]); os.chmod('bin/' + name, 0o755)"
    fake = f"#!/bin/sh\necho unconfined > {marker}\nexit 1\n"
    assert egressd_sandbox([], [*python_inside(write), fake], cwd=work).returncode == 0
    env = sandbox_env(work)
    env["PATH"] = f"{work / 'bin'}:{env['PATH']}"
    later = egressd_sandbox([], ["true"], cwd=work, env=env)
    assert later.returncode == 0, later.stderr
    assert not marker.exists()
    assert b"cannot capture" not in later.stderr  # the system's tools set the capture up


# The child's side of the CA tests: take HOME and GO, do what comes between, then say it waits,
# wait for GO, and list the files it finds in HOME.
CA_ARGS = """
    import json, os, sys, time
    home, go = sys.argv[1], sys.argv[2]
"""
CA_LOOK = """
    open("waiting", "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    found = []
    for top, dirs, files in os.walk(home):
        found += [os.path.relpath(os.path.join(top, f), home) for f in files]
    print(json.dumps(sorted(found)))
"""
WAIT_AND_LOOK = CA_ARGS + CA_LOOK


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _ca_rotated_while_the_child_looks(work: Path, home: Path, script: str) -> list[str]:
    """Run `script` in a sandbox whose egressd home is `home`, rotate the CA on the host while the
    child waits, and return the files the child then finds in `home`."""
    env = sandbox_env(work)
    env["EGRESSD_HOME"] = str(home)
    proc = subprocess.Popen(
        [*EGRESSD, "sandbox", "--", *python_inside(script), str(home), str(work / "go")],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_for(work / "waiting", proc)
        rotated = subprocess.run([*EGRESSD, "ca", "rotate"], env=env, capture_output=True, timeout=60)
        assert rotated.returncode == 0, rotated.stderr
        assert list((home / "ca").iterdir())  # the key exists on the host now
        (work / "go").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return json.loads(out)


def test_a_ca_created_during_the_run_stays_hidden(work: Path) -> None:
    home = work / ".egressd"  # visible to the child unless hidden; no CA yet, not even the directory
    assert _ca_rotated_while_the_child_looks(work, home, WAIT_AND_LOOK) == []


RENAME_AND_LOOK = (
    CA_ARGS
    + """
    parent = os.path.dirname(home)  # a plain directory of the working directory, above the hidden one
    try:
        os.rename(parent, parent + ".moved")  # the hidden tmpfs goes with it...
        os.makedirs(home)  # ...and the host path now leads to a directory the child reads
    except OSError as exc:
        print(json.dumps({"rename": exc.strerror}), file=sys.stderr)
"""
    + CA_LOOK
)


def test_a_hidden_home_cannot_be_moved_away_by_renaming_its_parent(work: Path) -> None:
    home = work / "state" / ".egressd"  # hidden; `state` is a plain directory the child can write
    # the CA key went to egressd's real home, never the child's
    assert _ca_rotated_while_the_child_looks(work, home, RENAME_AND_LOOK) == []
    assert not (work / "state.moved").exists()


# -- the user's credentials and start-up files ---------------------------------------------------
SECRETS = {
    ".ssh/id_ed25519": "PRIVATE KEY",
    ".aws/credentials": "aws_secret_access_key=x",
    ".npmrc": "//registry.npmjs.org/:_authToken=npm-secret",
    ".pypirc": "password = pypi-secret",
    ".netrc": "machine x login u password netrc-secret",
    ".git-credentials": "https://u:git-secret@example.test",
    ".config/gh/hosts.yml": "oauth_token: gh-secret",
    ".docker/config.json": '{"auths": {"x": {"auth": "docker-secret"}}}',
    ".kube/config": "token: kube-secret",
    ".gnupg/private-keys-v1.d/k.key": "gpg-secret",
    ".config/gcloud/credentials.db": "gcloud-secret",
    ".azure/msal_token_cache.json": "azure-secret",
    ".cargo/credentials.toml": 'token = "cargo-secret"',
    ".gem/credentials": ":rubygems_api_key: gem-secret",
    ".vault-token": "vault-secret",
    ".terraform.d/credentials.tfrc.json": '{"credentials": {"app.terraform.io": {"token": "tf-secret"}}}',
    ".config/hub": "oauth_token: hub-secret",
    ".config/glab-cli/config.yml": "token: glab-secret",
    ".config/composer/auth.json": '{"github-oauth": {"github.com": "composer-secret"}}',
    ".pulumi/credentials.json": '{"accessTokens": {"x": "pulumi-secret"}}',
    "notes/private.txt": "hidden by --hide",
}

READ_SECRETS = """
    import json, os, socket, sys
    home, names = sys.argv[1], sys.argv[2:]
    seen = {}
    for name in names:
        try:
            with open(os.path.join(home, name)) as f:
                seen[name] = f.read()
        except OSError as exc:
            seen[name] = exc.strerror
    agent = os.environ.get("SSH_AUTH_SOCK")
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(os.path.join(home, ".agent", "ssh.sock"))
        seen["agent"] = "CONNECTED"
    except OSError as exc:
        seen["agent"] = exc.strerror
    seen["SSH_AUTH_SOCK"] = agent
    seen["FOO"] = os.environ.get("FOO")
    seen["BAR"] = os.environ.get("BAR")
    print(json.dumps(seen))
"""


@pytest.fixture
def user_home(tmp_path: Path) -> Path:
    """A home full of credentials, with an ssh-agent socket listening, outside /tmp's privacy:
    bound under the working directory's parent, which the sandbox shows read-only."""
    home = tmp_path / "home"
    for name, text in SECRETS.items():
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text(text)
    (home / ".agent").mkdir()
    return home


def _credential_run(
    tmp_path: Path, home: Path, work: Path, options: list[str], extra_env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[bytes], dict[str, object]]:
    agent = socket.socket(socket.AF_UNIX)
    agent.bind(str(home / ".agent" / "ssh.sock"))
    agent.listen(5)
    env = sandbox_env(work)
    env.update(HOME=str(home), SSH_AUTH_SOCK=str(home / ".agent" / "ssh.sock"), FOO="foo", BAR="bar")
    env.update(extra_env or {})
    try:
        # the home is under /tmp here, which the sandbox makes private: --ro shows it, as a real
        # home (outside /tmp) is shown by the read-only root
        result = egressd_sandbox(
            ["--ro", str(home), *options],
            [*python_inside(READ_SECRETS), str(home), *SECRETS],
            cwd=work,
            env=env,
        )
    finally:
        agent.close()
    return result, (json.loads(result.stdout) if result.returncode == 0 else {})


def test_the_users_credentials_and_agent_are_hidden(tmp_path: Path, user_home: Path, work: Path) -> None:
    result, seen = _credential_run(
        tmp_path, user_home, work, ["--hide", str(user_home / "notes/private.txt")]
    )
    assert result.returncode == 0, result.stderr
    for name in SECRETS:
        assert seen[name] in ("Permission denied", "No such file or directory"), name  # covered
    assert seen["agent"] in ("Connection refused", "No such file or directory")
    assert seen["SSH_AUTH_SOCK"] is None
    assert seen["FOO"] == "foo"  # the rest of the environment passes by default


def test_show_lets_one_through_with_a_warning_and_env_clear_passes_only_what_is_named(
    tmp_path: Path, user_home: Path, work: Path
) -> None:
    result, seen = _credential_run(
        tmp_path, user_home, work, ["--show", str(user_home / ".npmrc"), "--env-clear", "--pass-env", "BAR"]
    )
    assert result.returncode == 0, result.stderr
    assert seen[".npmrc"] == SECRETS[".npmrc"]
    assert f"warning: --show {user_home / '.npmrc'}".encode() in result.stderr
    assert seen[".ssh/id_ed25519"] == "No such file or directory"
    assert seen["FOO"] is None and seen["BAR"] == "bar"


def test_a_mount_inside_hidden_credentials_needs_show(user_home: Path, work: Path) -> None:
    env = sandbox_env(work)
    env["HOME"] = str(user_home)
    result = egressd_sandbox(["--ro", str(user_home / ".ssh")], ["true"], cwd=work, env=env)
    assert result.returncode == 2
    assert b"which the sandbox hides" in result.stderr and b"--show" in result.stderr


def test_home_as_the_working_directory_is_refused_without_rw_home(user_home: Path, work: Path) -> None:
    env = sandbox_env(work)
    env["HOME"] = str(user_home)
    plant = ["sh", "-c", "echo evil >> .bashrc"]
    refused = egressd_sandbox(["--ro", str(user_home.parent)], plant, cwd=user_home, env=env)
    assert refused.returncode == 2
    assert b"home directory" in refused.stderr and b"--rw-home" in refused.stderr
    assert not (user_home / ".bashrc").exists()
    parent = egressd_sandbox([], plant, cwd=user_home.parent, env=env)  # an ancestor of the home
    assert parent.returncode == 2 and b"home directory" in parent.stderr
    rw = egressd_sandbox(["--rw", str(user_home)], plant, cwd=work, env=env)
    assert rw.returncode == 2 and b"--rw" in rw.stderr
    allowed = egressd_sandbox(
        ["--rw-home"],
        [*python_inside(READ_SECRETS), str(user_home), ".bashrc", ".ssh/id_ed25519"],
        cwd=user_home,
        env=env,
    )
    assert allowed.returncode == 0, allowed.stderr
    seen = json.loads(allowed.stdout)
    assert seen[".ssh/id_ed25519"] == "No such file or directory"  # still hidden


@pytest.mark.parametrize("directory", ["/etc", "/usr", "/var", "/usr/share"])
def test_a_system_directory_is_never_writable(directory: str, work: Path) -> None:
    result = egressd_sandbox(["--rw-home"], ["true"], cwd=Path(directory), env=sandbox_env(work))
    assert result.returncode == 2
    assert directory.encode() in result.stderr


# -- the host's loopback ---------------------------------------------------------------------------
def test_host_loopback_only_on_ports_the_policy_names(tmp_path: Path, work: Path) -> None:
    """Another proxy on the host's loopback (here any server: `egressd run --mode allow`, a
    corporate proxy, a database) is no way out of the sandbox unless its port is named."""
    with EchoHTTPServer("127.0.0.1", name="other-proxy") as other, EchoHTTPServer("127.0.0.1") as named:
        policy = write_policy(tmp_path, f"version: 1\nloopback: {{allow: true, ports: [{named.port}]}}\n")
        curl = ["curl", "-sS", "-i", "--max-time", "20"]
        preset = egressd_sandbox(
            ["--policy", "default"], [*curl, f"http://127.0.0.1:{other.port}/"], cwd=work
        )
        assert_refusal(preset, 403, "loopback_port", "http_request_denied")
        refused = egressd_sandbox(
            ["--policy", str(policy)], [*curl, f"http://127.0.0.1:{other.port}/"], cwd=work
        )
        assert_refusal(refused, 403, "loopback_port", "http_request_denied")
        assert f"--allow-loopback-port {other.port}".encode() in parse_http(refused.stdout)[2]
        tunnel = egressd_sandbox(
            ["--policy", str(policy)], [*curl, "-p", f"http://localhost:{other.port}/"], cwd=work
        )
        assert b"403" in tunnel.stdout.split(b"\r\n", 1)[0]
        assert other.connections == 0
        by_policy = egressd_sandbox(
            ["--policy", str(policy)], [*curl, f"http://127.0.0.1:{named.port}/"], cwd=work
        )
        assert parse_http(by_policy.stdout)[0] == 200, by_policy.stderr
        by_option = egressd_sandbox(
            ["--policy", str(policy), "--allow-loopback-port", str(other.port)],
            [*curl, f"http://127.0.0.1:{other.port}/"],
            cwd=work,
        )
        assert parse_http(by_option.stdout)[0] == 200, by_option.stderr
        assert other.connections == 1


# -- caches ----------------------------------------------------------------------------------------


def _npm_install(
    tmp_path: Path, work: Path, registry: NpmRegistry, dns: DnsServer, ca_file: Path, options: list[str]
) -> subprocess.CompletedProcess[bytes]:
    home = tmp_path / "home"
    (home / ".npm").mkdir(parents=True, exist_ok=True)  # the user's own cache: read-only inside
    (work / "package.json").write_text('{"name": "p", "version": "0.0.0", "private": true}')
    policy = write_policy(tmp_path, f"version: 1\nallow: [registry.test, {registry.host}]\n")
    env = sandbox_env(work)
    env = {k: v for k, v in env.items() if not k.lower().startswith(("npm_config_", "pip_"))}
    env.update(HOME=str(home), npm_config_update_notifier="false", npm_config_fetch_retries="0")
    env["npm_config_cafile"] = str(ca_file)
    return egressd_sandbox(
        # --ro shows the home as a real one (outside the private /tmp) is shown: read-only
        [
            "--policy",
            str(policy),
            "--nameserver",
            dns.nameserver,
            "--ro",
            str(ca_file.parent),
            "--ro",
            str(home),
        ]
        + options,
        ["npm", "install", "--no-audit", "--no-fund", "--registry", f"{registry.base_url}/", "egressd-tiny"],
        cwd=work,
        env=env,
        timeout=120,
    )


def test_npm_install_works_inside_with_a_private_cache(
    tmp_path: Path, work: Path, npm_registry: NpmRegistry, dns: DnsServer, ca_file: Path
) -> None:
    result = _npm_install(tmp_path, work, npm_registry, dns, ca_file, [])
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert (work / "node_modules" / "egressd-tiny-dep" / "package.json").exists()
    assert list((tmp_path / "home" / ".npm").iterdir()) == []  # the user's cache untouched


def test_cache_dir_is_reused_between_runs(
    tmp_path: Path, work: Path, npm_registry: NpmRegistry, dns: DnsServer, ca_file: Path
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    result = _npm_install(tmp_path, work, npm_registry, dns, ca_file, ["--cache", str(cache)])
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert (cache / "npm" / "_cacache").is_dir()

"""The sandbox as users run it: not root, with a real home that holds more secrets than any list.

Every test runs `egressd sandbox` as a user who is not root (a fresh `useradd -m` user when the
tests run as root, else the user running them) from a project in that user's home. Inside, the
home is empty but for the project, what `--rw`/`--ro`/`--show` name and a short list of harmless
configuration; the sources of the policy's secrets are never readable, wherever they are.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.audit_log import audit_records
from tests.support.egressd_cli import EGRESSD
from tests.support.unprivileged import User, unprivileged_user

# What a home holds that no blocklist named: each must stay out of the child's reach.
HOME_SECRETS = {
    ".bash_history": "export GITHUB_TOKEN=bash-history-secret",
    ".zsh_history": ": 1700000000:0;export AWS_SECRET=zsh-history-secret",
    ".pgpass": "db:5432:*:u:pgpass-secret",
    ".local/share/keyrings/login.keyring": "keyring-secret",
    ".mozilla/firefox/abc.default-release/logins.json": '{"logins": "browser-secret"}',
    ".config/google-chrome/Default/Cookies": "chrome-cookie-secret",
    ".config/containers/auth.json": '{"auths": {"r": {"auth": "containers-secret"}}}',
    ".m2/settings.xml": "<password>maven-secret</password>",
    ".gradle/gradle.properties": "signing.password=gradle-secret",
    ".my.cnf": "[client]\npassword=mycnf-secret",
    ".s3cfg": "secret_key = s3cfg-secret",
    ".claude.json": '{"oauthAccount": "claude-secret"}',
    ".codex/auth.json": '{"OPENAI_API_KEY": "codex-secret"}',
    ".npmrc": "//registry.npmjs.org/:_authToken=npmrc-secret",
    ".netrc": "machine x login u password netrc-secret",
    ".pypirc": "password = pypirc-secret",
    ".git-credentials": "https://u:gitcred-secret@example.test",
    ".bashrc": "export OPENAI_API_KEY=bashrc-secret",
    ".config/some-new-tool/token": "new-tool-secret",  # the next one no list names
}
# What the child gets where a file is hidden: nothing there (the masked home), or an empty stand-in
# it may not open (a non-root user's bind of /dev/null is on a nodev mount).
HIDDEN = ("No such file or directory", "Permission denied", "")
# Container engines' API sockets under the home: Docker API access is root on the host.
SOCKETS = (".colima/default/docker.sock", ".rd/docker.sock", ".lima/default/sock/docker.sock")

PROBE = """
import json, os, socket, sys
spec = json.loads(sys.argv[1])
seen = {}
def attempt(key, action):
    try:
        seen[key] = action()
    except OSError as exc:
        seen[key] = exc.strerror
def read(path):
    with open(os.path.expanduser(path)) as f:
        return f.read()
def connect(path):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.path.expanduser(path))
    return "CONNECTED"
def write(path):
    with open(os.path.expanduser(path), "w") as f:
        f.write("planted")
    return "DONE"
for path in spec.get("read", []):
    attempt(path, lambda: read(path))
for path in spec.get("connect", []):
    attempt(path, lambda: connect(path))
for path in spec.get("write", []):
    attempt("write " + path, lambda: write(path))
for old, new in spec.get("rename", []):
    attempt("rename " + old, lambda: os.rename(os.path.expanduser(old), os.path.expanduser(new)) or "DONE")
seen["listing"] = sorted(os.listdir(os.path.expanduser("~")))
seen["env"] = {k: v for k, v in os.environ.items() if k in spec.get("env", [])}
print(json.dumps(seen))
"""


def probe(spec: dict[str, object]) -> list[str]:
    return [sys.executable, "-c", PROBE, json.dumps(spec)]


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    with unprivileged_user() as created:
        for name, text in HOME_SECRETS.items():
            created.write(name, text)
        created.write(".gitconfig", "[user]\n\tname = Test User\n\temail = t@example.test\n", 0o644)
        # listed as harmless, but this one carries a token: not shown
        created.write(".config/git/config", "[http]\n\textraHeader = Authorization: Bearer gitcfg-secret\n")
        created.write("shown/notes.txt", "shown with --show", 0o644)
        created.write("proj/main.py", "print('the project')\n", 0o644)
        created.write(".local/bin/mytool", "#!/bin/sh\necho mytool ran\n", 0o755)
        created.mkdir("proj/.t")
        yield created


@pytest.fixture
def sockets(user: User) -> Iterator[None]:
    """Container engines' sockets, listening, connectable by the user outside the sandbox."""
    listening = []
    try:
        for name in SOCKETS:
            path = user.home / name
            user.mkdir(str(path.parent.relative_to(user.home)))
            path.unlink(missing_ok=True)
            server = socket.socket(socket.AF_UNIX)
            server.bind(str(path))
            server.listen(5)
            user.own(path)
            listening.append(server)
        yield
    finally:
        for server in listening:
            server.close()


def sandbox(user: User, options: list[str], command: list[str], **kwargs: object) -> object:
    env = {"TMPDIR": str(user.home / "proj" / ".t")}
    env.update(kwargs.pop("env", {}))  # type: ignore[arg-type]
    return user.run(
        [*EGRESSD, "sandbox", *options, "--", *command], cwd=user.home / "proj", env=env, **kwargs
    )  # type: ignore[arg-type]


def test_the_home_is_hidden_but_for_the_project_and_what_is_shown(user: User, sockets: None) -> None:
    link = user.home / "proj" / "pgpass-link"  # left in the project: it leads into the hidden home
    link.unlink(missing_ok=True)
    link.symlink_to(user.home / ".pgpass")
    user.own(link)
    spec = {
        "read": [
            *(f"~/{name}" for name in HOME_SECRETS),
            "~/shown/notes.txt",
            "~/.gitconfig",
            "~/.config/git/config",
            "~/proj/main.py",
            "~/proj/pgpass-link",
        ],
        "connect": [f"~/{name}" for name in SOCKETS],
        "write": ["~/planted", "~/.bashrc", "~/shown/planted", "~/proj/made-inside"],
        "rename": [["~/shown", "~/moved"]],
    }
    result = sandbox(user, ["--show", "~/shown/notes.txt"], probe(spec))
    assert result.returncode == 0, result.stderr.decode()
    seen = json.loads(result.stdout)
    for name in HOME_SECRETS:
        assert seen[f"~/{name}"] == "No such file or directory", name
    for name in SOCKETS:
        assert seen[f"~/{name}"] == "No such file or directory", name
    assert seen["~/proj/pgpass-link"] == "No such file or directory"
    assert seen["~/.config/git/config"] == "No such file or directory"  # holds a token: withheld
    assert seen["~/shown/notes.txt"] == "shown with --show"
    assert "Test User" in seen["~/.gitconfig"]  # harmless configuration, shown by default
    assert seen["~/proj/main.py"] == "print('the project')\n"
    assert seen["write ~/planted"] == "Read-only file system"
    assert seen["write ~/.bashrc"] == "Read-only file system"
    assert seen["write ~/shown/planted"] == "Read-only file system"
    assert seen["write ~/proj/made-inside"] == "DONE"
    assert seen["rename ~/shown"] in ("Read-only file system", "Device or resource busy")
    assert seen["listing"] == [".gitconfig", "proj", "shown"]
    assert (user.home / "proj" / "made-inside").read_text() == "planted"
    assert not (user.home / "planted").exists()
    for name, text in HOME_SECRETS.items():
        assert text not in result.stdout.decode(), name


def test_git_finds_the_users_name_inside(user: User) -> None:
    """The harmless list exists so common tools keep working: git reads ~/.gitconfig."""
    result = sandbox(user, [], ["git", "config", "--global", "user.name"])
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.strip() == b"Test User"


def test_explain_lists_what_is_shown_hidden_and_writable(user: User) -> None:
    result = user.run(
        [*EGRESSD, "sandbox", "--show", "~/shown/notes.txt", "--explain"],
        cwd=user.home / "proj",
    )
    assert result.returncode == 0, result.stderr.decode()
    text = result.stdout.decode()
    writable, read_only, hidden = (
        text.split("Writable:")[1].split("Read-only:")[0],
        text.split("Read-only:")[1].split("Hidden:")[0],
        text.split("Hidden:")[1],
    )
    home = str(user.home)
    assert f"{home}/proj " in writable and "the working directory" in writable
    assert f"{home}/shown/notes.txt" in read_only and f"{home}/.gitconfig" in read_only
    hidden_names = hidden.split("hidden in it:")[1].splitlines()[0]
    for name in (".bash_history", ".zsh_history", ".pgpass", ".m2", ".gradle", ".my.cnf", ".s3cfg",
                 ".claude.json", ".codex", ".colima", ".rd", ".mozilla", ".npmrc", ".bashrc"):  # fmt: skip
        assert name in hidden_names, name
    assert "shown (partly shown)" in hidden_names and ".config (partly shown)" not in hidden_names
    assert f"{home}/.config/git/config" in text.split("not shown:")[1]  # withheld, and why
    assert "gitcfg-secret" not in text
    assert not (user.home / "proj" / "ran").exists()


def test_a_command_that_needed_the_home_gets_told_about_show(user: User) -> None:
    failed = sandbox(user, [], ["sh", "-c", "cat ~/.pgpass"])
    assert failed.returncode == 1
    assert b"--show PATH" in failed.stderr and b"--explain" in failed.stderr
    env = {"PATH": f"{user.home}/.local/bin:{os.environ['PATH']}"}
    missing = sandbox(user, [], ["mytool"], env=env)
    assert missing.returncode == 127
    assert f"--show {user.home}/.local/bin".encode() in missing.stderr
    shown = sandbox(user, ["--show", "~/.local/bin"], ["mytool"], env=env)
    assert shown.returncode == 0, shown.stderr.decode()
    assert shown.stdout.strip() == b"mytool ran"


@pytest.mark.parametrize(
    ("option", "path"),
    [
        ("~/proj/../.pgpass", "~/.pgpass"),  # `..` resolved: it names the credential, shown as asked
        ("~/shown/./notes.txt/", "~/shown/notes.txt"),
    ],
)
def test_show_paths_are_canonical(user: User, option: str, path: str) -> None:
    result = sandbox(user, ["--show", option], probe({"read": ["~/.pgpass", "~/shown/notes.txt"]}))
    assert result.returncode == 0, result.stderr.decode()
    seen = json.loads(result.stdout)
    other = "~/shown/notes.txt" if path == "~/.pgpass" else "~/.pgpass"
    assert seen[path] == (HOME_SECRETS[".pgpass"] if path == "~/.pgpass" else "shown with --show")
    assert seen[other] == "No such file or directory"
    assert f"warning: --show {user.home}/{path[2:]}".encode() in result.stderr


def test_egressd_home_is_never_shown_whatever_the_spelling(user: User) -> None:
    user.mkdir(".config/egressd")
    for spelling in ("~/.config/egressd", "~/.config/./egressd/", "~/proj/../.config/egressd"):
        result = sandbox(user, ["--show", spelling], ["true"])
        assert result.returncode == 2, spelling
        assert b"never shown" in result.stderr


def test_a_show_through_a_symlink_in_the_project_is_refused(user: User) -> None:
    """An earlier child leaves `proj/docs -> ~/.ssh`; `--show docs` must not show the keys."""
    user.write(".ssh/id_ed25519", "PRIVATE KEY")
    link = user.home / "proj" / "docs"
    link.unlink(missing_ok=True)
    link.symlink_to(user.home / ".ssh")
    user.own(link)
    result = sandbox(user, ["--show", "docs"], ["cat", "docs/id_ed25519"])
    assert result.returncode == 2
    assert b"symlink" in result.stderr and b"PRIVATE KEY" not in result.stdout


def test_the_home_as_the_project_shows_it_but_not_the_credentials(user: User) -> None:
    """`--rw-home` from the home itself: the project IS the home, so it is shown (writable); the
    credentials of the list stay hidden."""
    result = user.run(
        [
            *EGRESSD,
            "sandbox",
            "--rw-home",
            "--",
            *probe({"read": ["~/.npmrc", "~/.pgpass", "~/shown/notes.txt"]}),
        ],
        cwd=user.home,
        env={"TMPDIR": str(user.home / "proj" / ".t")},
    )
    assert result.returncode == 0, result.stderr.decode()
    seen = json.loads(result.stdout)
    assert seen["~/.npmrc"] in HIDDEN
    assert seen["~/.pgpass"] in HIDDEN
    assert seen["~/shown/notes.txt"] == "shown with --show"


# -- the sources of the policy's secrets ---------------------------------------------------------
def _secret_policy(user: User, secrets: str) -> Path:
    return user.write("agent.yaml", f"version: 1\nallow: [up.test]\nsecrets:\n{secrets}", 0o600)


def _file_secret(name: str, path: str) -> str:
    return (
        f"  - name: {name}\n    from: {{file: {path}}}\n    hosts: [up.test]\n"
        f"    header: 'x-{name}: {{}}'\n    env: {name.upper()}_KEY\n"
    )


def _command_secret(name: str, argv: list[str]) -> str:
    return (
        f"  - name: {name}\n    from: {{command: {json.dumps(argv)}}}\n    hosts: [up.test]\n"
        f"    header: 'x-{name}: {{}}'\n    env: {name.upper()}_KEY\n"
    )


@pytest.fixture
def outside(user: User) -> Iterator[Path]:
    """A directory of the user's outside the home and outside /tmp: the read-only root shows it."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="egressd-keys-", dir="/var/tmp"))
    path.chmod(0o755)
    if user.switch:
        os.chown(path, user.uid, user.gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _key(user: User, path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    user.own(path)
    return path


def test_no_source_of_a_secret_is_readable(user: User, outside: Path) -> None:
    user.write(".config/keys/anthropic", "sk-ant-file-secret")
    _key(user, outside / "maps", "maps-file-secret")
    cmdkey = user.write("proj/.keys/cmdkey", "command-secret")
    policy = _secret_policy(
        user,
        _file_secret("anthropic", "~/.config/keys/anthropic")
        + _file_secret("maps", str(outside / "maps"))
        + _command_secret("cmd", ["cat", str(cmdkey)]),
    )
    link = user.home / "proj" / "key-link"
    link.unlink(missing_ok=True)
    link.symlink_to(user.home / ".config" / "keys" / "anthropic")
    user.own(link)
    reads = ["~/.config/keys/anthropic", str(outside / "maps"), str(cmdkey), "~/proj/key-link"]
    spec = {"read": reads, "env": ["ANTHROPIC_KEY", "MAPS_KEY", "CMD_KEY"]}
    # shown or not, the home's keys stay hidden: --show ~/.config shows the directory that holds one
    for options in ([], ["--show", "~/.config"]):
        result = sandbox(user, ["--policy", str(policy), *options], probe(spec))
        assert result.returncode == 0, result.stderr.decode()
        seen = json.loads(result.stdout)
        for path in reads:
            assert seen[path] in HIDDEN, (options, path)
        assert seen["env"]["ANTHROPIC_KEY"].startswith("egressd-secret-anthropic-")
        assert seen["env"]["MAPS_KEY"].startswith("egressd-secret-maps-")
        for secret in (b"sk-ant-file-secret", b"maps-file-secret", b"command-secret"):
            assert secret not in result.stdout


def test_a_source_with_another_hard_link_or_shown_is_refused(user: User, outside: Path) -> None:
    key = _key(user, outside / "linked", "linked-secret")
    os.link(key, outside / "second-link")
    policy = _secret_policy(user, _file_secret("linked", str(key)))
    linked = sandbox(user, ["--policy", str(policy)], ["cat", str(key)])
    assert linked.returncode == 2 and b"hard links" in linked.stderr
    assert b"linked-secret" not in linked.stdout
    (outside / "second-link").unlink()
    shown = sandbox(user, ["--policy", str(policy), "--ro", str(key)], ["cat", str(key)])
    assert shown.returncode == 2 and b"secret 'linked'" in shown.stderr
    assert b"linked-secret" not in shown.stdout


RELOAD_AND_WAIT = """
import os, sys, time
open("waiting", "w").close()
deadline = time.monotonic() + 60
while not os.path.exists("go") and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _reload_result(user: User, audit: Path, policy: Path, text: str, seen: int) -> dict[str, object]:
    policy.write_text(text)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        records = [r for r in audit_records(audit) if r.get("event") in ("reload", "reload_failed")]
        if len(records) > seen:
            return records[-1]
        time.sleep(0.1)
    raise AssertionError("no reload within 30 s")


def test_a_reload_naming_a_visible_source_is_refused_and_a_hidden_one_applies(
    user: User, outside: Path
) -> None:
    user.write(".config/keys/first", "first-secret")
    _key(user, outside / "visible", "visible-secret")
    user.write(".config/keys/hidden", "hidden-secret")
    policy = _secret_policy(user, _file_secret("first", "~/.config/keys/first"))
    audit = user.home / "audit.jsonl"
    audit.unlink(missing_ok=True)
    (user.home / "proj" / "waiting").unlink(missing_ok=True)
    (user.home / "proj" / "go").unlink(missing_ok=True)
    proc = user.popen(
        [*EGRESSD, "sandbox", "--policy", str(policy), "--audit", str(audit), "--", sys.executable, "-c",
         RELOAD_AND_WAIT],
        cwd=user.home / "proj",
        env={"TMPDIR": str(user.home / "proj" / ".t")},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (user.home / "proj" / "waiting").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        head = policy.read_text()
        refused = _reload_result(
            user, audit, policy, head + _file_secret("later", str(outside / "visible")), 0
        )
        assert refused["event"] == "reload_failed"
        assert str(outside / "visible") in str(refused["error"]) and "shows to the child" in str(
            refused["error"]
        )
        applied = _reload_result(
            user, audit, policy, head + _file_secret("later", "~/.config/keys/hidden"), 1
        )
        assert applied["event"] == "reload", applied
        (user.home / "proj" / "go").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err.decode()

"""egressd's Seatbelt profile against sandbox-runtime's and Codex's for the same run.

The peers' profiles (tests/support/peer_profiles/, each naming its source, version and how it was
produced) are loaded into the same rule model as egressd's, for one run: a project writable but
its .git, ~/.ssh, ~/.npmrc and egressd's home unreadable, the proxy on ports 49152 and 49153.
Every probe egressd allows that both peers deny is flagged: two independent designs refusing
what egressd allows is a hole until shown otherwise. The list of flagged probes must be empty,
or name why each is allowed on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.seatbelt_layouts import _profile
from tests.support.seatbelt_model import Model, tinyscheme_available

PEERS = Path(__file__).resolve().parents[1] / "support" / "peer_profiles"
TIOCSTI = 0x80017472
HOME = "/Users/u"

PROBES: list[tuple[str, dict[str, object]]] = [
    *(
        ("file-read-data", {"path": f"{HOME}/{p}"})
        for p in (".ssh/id_ed25519", ".npmrc", ".config/egressd/ca/key.pem")
    ),
    *(("file-read-data", {"path": p}) for p in (f"{HOME}/project/src/a.py", "/etc/hosts", "/usr/bin/git")),
    *(
        ("file-write-data", {"path": p})
        for p in (
            f"{HOME}/project/src/a.py",
            f"{HOME}/project/.git/config",
            f"{HOME}/project/.git/hooks/pre-commit",
            f"{HOME}/.zshrc",
            f"{HOME}/.ssh/authorized_keys",
            "/etc/hosts",
            "/private/tmp/x",
            "/private/var/folders/xy/T/x",
        )
    ),
    ("file-write-data", {"path": "/dev/null", "vnode": "character-device"}),
    *(
        ("file-write-create", {"path": p})
        for p in (f"{HOME}/project/.vscode/tasks.json", f"{HOME}/project/.mcp.json", f"{HOME}/planted")
    ),
    ("file-write-unlink", {"path": f"{HOME}/project"}),
    ("file-link", {"path": f"{HOME}/project/link"}),
    *(
        ("process-exec", {"path": p})
        for p in ("/usr/bin/git", "/usr/bin/sudo", "/bin/ps", f"{HOME}/project/run.sh")
    ),
    *(
        ("network-outbound", {"remote": (proto, host, port), "local": (proto, "0.0.0.0", 0)})
        for proto in ("tcp", "udp")
        for host in ("127.0.0.1", "::1", "198.51.100.7")
        for port in (22, 53, 443, 49152, 49153)
    ),
    ("network-outbound", {"remote": ("unix", "/private/var/run/mDNSResponder", None)}),
    *(
        (op, {"local": ("tcp", "127.0.0.1", port)})
        for op in ("network-bind", "network-inbound")
        for port in (8000, 49152)
    ),
    *(
        ("sysctl-read", {"sysctl": n})
        for n in ("kern.procargs2", "kern.proc.all", "hw.ncpu", "kern.proc.pid.1")
    ),
    ("sysctl-write", {"sysctl": "kern.grade_cputype"}),
    *(
        ("mach-lookup", {"name": n})
        for n in (
            "com.apple.system.opendirectoryd.libinfo",
            "com.apple.trustd.agent",
            "com.apple.SecurityServer",
            "com.apple.coreservices.launchservicesd",
            "com.apple.cfprefsd.daemon",
        )
    ),
    *(
        (op, {})
        for op in (
            "lsopen",
            "appleevent-send",
            "mach-register",
            "pseudo-tty",
            "iokit-open",
            "user-preference-read",
        )
    ),
    ("system-socket", {"socket_domain": "af_unix"}),
    ("signal", {"target": "other"}),
    ("process-info-pidinfo", {"target": "other"}),
    ("file-ioctl", {"path": "/dev/tty", "ioctl": TIOCSTI}),
    ("file-ioctl", {"path": "/dev/ttys003", "ioctl": TIOCSTI}),
]

# What egressd allows that both peers refuse, on purpose, and why.
ALLOWED_ON_PURPOSE: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def models() -> dict[str, Model]:
    if not tinyscheme_available():
        pytest.fail("tinyscheme is not installed: run scripts/setup.sh (apt-get install tinyscheme)")
    params = json.loads((PEERS / "codex.params.json").read_text())
    return {
        "egressd": Model.of(_profile()),
        "sandbox-runtime": Model.of((PEERS / "sandbox-runtime-0.0.83.sb").read_text()),
        "codex": Model.of((PEERS / "codex.sb").read_text(), params=params),
    }


def _key(operation: str, probe: dict[str, object]) -> tuple[str, str]:
    return operation, json.dumps(probe, sort_keys=True)


def test_nothing_egressd_allows_is_refused_by_both_peers(models: dict[str, Model]) -> None:
    flagged = []
    for operation, probe in PROBES:
        answers = {name: model.decide(operation, **probe) for name, model in models.items()}
        if answers["egressd"] == "allow" and answers["sandbox-runtime"] == answers["codex"] == "deny":
            flagged.append(_key(operation, probe))
    assert [k for k in flagged if k not in ALLOWED_ON_PURPOSE] == []


def test_the_peers_profiles_are_read_as_their_authors_meant(models: dict[str, Model]) -> None:
    """The differential is only as good as the model's reading of the peers: what each is known
    to allow and refuse (from their own documentation and tests) must come out so."""
    srt, codex = models["sandbox-runtime"], models["codex"]
    for peer in (srt, codex):
        assert peer.decide("network-outbound", remote=("tcp", "127.0.0.1", 49152)) == "allow"
        assert peer.decide("network-outbound", remote=("tcp", "198.51.100.7", 443)) == "deny"
        assert peer.decide("file-read-data", path=f"{HOME}/.ssh/id_ed25519") == "deny"
        assert peer.decide("file-write-data", path=f"{HOME}/project/src/a.py") == "allow"
        assert peer.decide("file-write-data", path=f"{HOME}/project/.git/config") == "deny"
        assert peer.decide("sysctl-read", sysctl="kern.procargs2") == "deny"
    assert srt.decide("mach-lookup", name="com.apple.coreservices.launchservicesd") == "allow"
    assert codex.decide("mach-lookup", name="com.apple.trustd.agent") == "allow"
    assert codex.decide("process-exec", path="/bin/ps") == "allow"  # with no-sandbox, on purpose
    # where the peers are wider than egressd: reported, not flagged (egressd refuses more)
    assert models["egressd"].decide("mach-lookup", name="com.apple.trustd.agent") == "deny"

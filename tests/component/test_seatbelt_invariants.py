"""What every generated Seatbelt profile must hold, checked the way a Mac would read it.

Each profile is evaluated by Debian's tinyscheme with only the names macOS 13's profile language
knows bound (a name it lacks fails here as `sandbox-exec` fails there: exit 65, nothing runs),
and its rules are asked questions through the model of Seatbelt's precedence
(tests/support/seatbelt_model.py). The denials are required under both readings of precedence
the model knows (Seatbelt's observed one and the plain last-match one), so none rests on which
is Apple's. Scenarios: the golden layout, a layout planned from real files, `--serve`, and a home
shown with `--rw-home` (where the listed credentials that do not exist are hidden too).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from egressd.sandbox import leftovers
from egressd.sandbox.layout import Layout, plan_layout
from egressd.sandbox.mounts import within
from egressd.sandbox.seatbelt import (
    MACH_SERVICES,
    PRIVILEGED_PROGRAMS,
    PRIVILEGED_STATE,
    TIOCSTI,
    run_marker,
    seatbelt_profile,
    spellings,
)
from egressd.sandbox.shields import CREDENTIALS
from egressd.session import SessionOptions
from tests.support.seatbelt_layouts import LAYOUT, NEEDED, _named
from tests.support.seatbelt_model import (
    EXEC_OPERATIONS,
    READ_OPERATIONS,
    WRITE_OPERATIONS,
    Model,
    ProfileError,
    Rule,
    Sym,
    evaluate,
    tinyscheme_available,
)

PROXY = [49152, 49153]
TEMP = "/private/var/folders/xy/T/egressd-run-abc"
MARKER = run_marker("0123abcd")
OTHER_MARKER = run_marker("4567ef01")
# test_seatbelt's layout, with the home masked and two listed credentials that do not exist
GOLDEN_LAYOUT = replace(LAYOUT, masked=("/Users/u",), absent=("/Users/u/.aws", "/Users/u/Library/Keychains"))
SHOWN_INSIDE_HIDDEN = ("/Users/u/.ssh/known_hosts", "/Users/u/.config/egressd/ca.pem")


@pytest.fixture(autouse=True)
def _require() -> None:
    if not tinyscheme_available():
        pytest.fail("tinyscheme is not installed: run scripts/setup.sh (apt-get install tinyscheme)")


def _profile(layout: Layout = GOLDEN_LAYOUT, serve: Sequence[int] = (), marker: str = MARKER) -> str:
    return seatbelt_profile(
        layout,
        PROXY,
        temp=[TEMP],
        home="/Users/u",
        needed=NEEDED,
        terminals=["/dev/ttys003"],
        serve=serve,
        marker=marker,
    )


def _models(profile: str) -> tuple[Model, Model]:
    rules = evaluate(profile)
    return Model(rules, "seatbelt"), Model(rules, "last-match")


def _denied_under_both(models: tuple[Model, Model], operation: str, **probe: object) -> bool:
    return all(m.decide(operation, **probe) == "deny" for m in models)


# -- the profile language of the oldest supported macOS -------------------------------------------
def test_a_symbol_macos_13_lacks_fails_the_profile_as_sandbox_exec_does() -> None:
    """The rule egressd wrote before (and two peers shipped): `TIOCSTI` is unbound on macOS 13.7
    and 14.2-14.3, where sandbox-exec then refuses the whole profile (exit 65)."""
    symbolic = _profile().replace(f"(ioctl-command #x{TIOCSTI:08x})", "(ioctl-command TIOCSTI)")
    assert symbolic != _profile()
    with pytest.raises(ProfileError, match="unbound variable: tiocsti"):
        evaluate(symbolic)


@pytest.mark.parametrize("serve", [(), (8000,)])
def test_every_generated_profile_evaluates(serve: tuple[int, ...]) -> None:
    rules = evaluate(_profile(serve=serve))
    assert rules[0] == Rule("version", (), (1,), ())
    assert rules[1] == Rule("deny", ("default",), (), ())  # the first guard
    assert not any(r.action == "allow" and "default" in r.operations for r in rules)


# -- the network ------------------------------------------------------------------------------------
HOSTS = ("127.0.0.1", "::1", "::ffff:127.0.0.1", "0.0.0.0", "10.0.0.1", "198.51.100.7", "2001:db8::1")
PORTS = (22, 53, 80, 443, 3128, 8000, 8080, *PROXY)


@pytest.mark.parametrize("serve", [(), (8000,)])
def test_outbound_only_tcp_to_the_proxy_ports_on_the_loopback(serve: tuple[int, ...]) -> None:
    models = _models(_profile(serve=serve))
    for proto in ("tcp", "udp"):
        for host in HOSTS:
            for port in PORTS:
                probe = {"remote": (proto, host, port), "local": (proto, "0.0.0.0", 0)}
                if proto == "tcp" and host in ("127.0.0.1", "::1") and port in PROXY:
                    assert models[0].decide("network-outbound", **probe) == "allow", probe
                else:
                    assert _denied_under_both(models, "network-outbound", **probe), probe
    for socket_path in ("/private/var/run/mDNSResponder", "/var/run/docker.sock", "/Users/u/.ssh/agent"):
        assert _denied_under_both(models, "network-outbound", remote=("unix", socket_path, None))


@pytest.mark.parametrize("serve", [(), (8000,)])
def test_no_bind_or_inbound_but_the_served_ports(serve: tuple[int, ...]) -> None:
    models = _models(_profile(serve=serve))
    for operation in ("network-bind", "network-inbound"):
        for proto in ("tcp", "udp"):
            for host in ("127.0.0.1", "::1", "0.0.0.0", "10.0.0.1"):
                for port in (0, *PORTS):
                    probe = {"local": (proto, host, port)}
                    if proto == "tcp" and port in serve and host != "10.0.0.1":
                        assert models[0].decide(operation, **probe) == "allow", (operation, probe)
                    else:
                        assert _denied_under_both(models, operation, **probe), (operation, probe)


# -- processes, sysctls, Mach ---------------------------------------------------------------------
def test_no_process_reads_another_ones_arguments_or_environment() -> None:
    models = _models(_profile())
    for name in (
        "kern.procargs",
        "kern.procargs2",
        "kern.procargs2.1",
        "kern.proc.all",
        "kern.proc.ruid.501",
    ):
        assert _denied_under_both(models, "sysctl-read", sysctl=name), name
    for name in ("hw.ncpu", "kern.osproductversion", "kern.proc.pid.123", "hw.optional.arm64"):
        assert models[0].decide("sysctl-read", sysctl=name) == "allow", name
    for name in ("kern.hostname", "kern.tcsm_enable", "hw.ncpu"):
        assert _denied_under_both(models, "sysctl-write", sysctl=name), name


def test_the_mach_services_are_exactly_the_designed_ones() -> None:
    rules = evaluate(_profile())
    granted = [f for r in rules if r.action == "allow" and "mach-lookup" in r.operations for f in r.filters]
    assert granted == [[Sym("global-name"), name] for name, _why in MACH_SERVICES]
    models = _models(_profile())
    for name, _why in MACH_SERVICES:
        assert models[0].decide("mach-lookup", name=name) == "allow"
    for name in (
        "com.apple.trustd.agent",
        "com.apple.ocspd",
        "com.apple.SecurityServer",
        "com.apple.securityd.xpc",
        "com.apple.mDNSResponder",
        "com.apple.dnssd.service",
        "com.apple.coreservices.launchservicesd",
        "com.apple.lsd.mapdb",
        "com.apple.pasteboard.1",
        "com.apple.windowserver.active",
        "com.apple.cfprefsd.daemon",
        "com.apple.SystemConfiguration.configd",
        "com.apple.networkd",
    ):
        assert _denied_under_both(models, "mach-lookup", name=name), name


# Operations no profile of egressd's ever allows, whatever the target.
NEVER = (
    "lsopen",
    "appleevent-send",
    "mach-register",
    "mach-priv-task-port",
    "mach-priv-host-port",
    "mach-cross-domain-lookup",
    "system-socket",
    "sysctl-write",
    "iokit-open",
    "iokit-set-properties",
    "nvram-set",
    "nvram-delete",
    "system-privilege",
    "system-kext-load",
    "system-set-time",
    "system-fsctl",
    "file-mount",
    "file-unmount",
    "file-chroot",
    "fs-snapshot-create",
    "fs-snapshot-revert",
    "job-creation",
    "user-preference-write",
    "distributed-notification-post",
    "process-codesigning-status-set",
    "authorization-right-obtain",
    "opendirectory-user-modify",
)


@pytest.mark.parametrize("serve", [(), (8000,)])
def test_operations_that_are_never_allowed(serve: tuple[int, ...]) -> None:
    profile = _profile(serve=serve)
    models = _models(profile)
    for operation in NEVER:
        for probe in ({}, {"target": "same-sandbox"}, {"target": "other"}, {"socket_domain": "af_unix"}):
            assert _denied_under_both(models, operation, **probe), (operation, probe)
    for operation in ("signal", "process-info-pidinfo", "process-info-setcontrol"):
        assert _denied_under_both(models, operation, target="other"), operation
    rules = evaluate(profile)
    assert not any("no-sandbox" in r.modifiers for r in rules)  # no program runs unconfined


def test_privileged_programs_and_their_tickets() -> None:
    models = _models(_profile())
    for program in PRIVILEGED_PROGRAMS:
        for operation in EXEC_OPERATIONS:
            assert _denied_under_both(models, operation, path=program), program
    for path in spellings(PRIVILEGED_STATE + "/ts/u"):
        assert _denied_under_both(models, "file-read-data", path=path)


def test_terminals_no_tiocsti_by_number() -> None:
    models = _models(_profile())
    for tty in ("/dev/tty", "/dev/ttys003"):
        assert _denied_under_both(models, "file-ioctl", path=tty, ioctl=TIOCSTI)
        assert models[0].decide("file-ioctl", path=tty, ioctl=0x40087468) == "allow"  # TIOCGWINSZ


# -- files ------------------------------------------------------------------------------------------
def _hidden_probes(layout: Layout) -> Iterator[str]:
    for top in (*layout.hidden, *layout.absent, PRIVILEGED_STATE):
        for path in (top, f"{top}/inner", f"{top}/a/b"):
            for spelled in spellings(path):
                if not any(within(spelled, shown) for shown in SHOWN_INSIDE_HIDDEN):
                    yield spelled


def _guarded_probes(layout: Layout) -> Iterator[str]:
    for top in (*layout.guarded, *(c.path for c in layout.covers if c.kind == "ro")):
        for path in (top, f"{top}/inner"):
            yield from spellings(path)


def test_every_hidden_path_in_every_spelling_is_neither_read_written_nor_run() -> None:
    models = _models(_profile())
    for path in _hidden_probes(GOLDEN_LAYOUT):
        for operation in (*READ_OPERATIONS, *WRITE_OPERATIONS, *EXEC_OPERATIONS):
            assert _denied_under_both(models, operation, path=path), (operation, path)


def test_every_guarded_path_is_denied_every_write_including_creation() -> None:
    models = _models(_profile())
    for path in _guarded_probes(GOLDEN_LAYOUT):
        for operation in WRITE_OPERATIONS:
            assert _denied_under_both(models, operation, path=path), (operation, path)


def test_writes_go_only_to_the_project_and_the_runs_own_directory() -> None:
    model = _models(_profile())[0]
    for path in (f"{TEMP}/x", f"{TEMP.removeprefix('/private')}/x", "/Users/u/project/src/a.c"):
        assert model.decide("file-write-create", path=path) == "allow", path
    for path in ("/private/tmp/x", "/tmp/x", "/private/var/folders/xy/T/x", "/Users/u/x", "/etc/hosts"):
        for operation in WRITE_OPERATIONS:
            assert _denied_under_both(_models(_profile()), operation, path=path), (operation, path)


@pytest.fixture
def real_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "Users" / "u"
    for directory in (home / "project", home / ".ssh", home / "Library" / "Application Support" / "Slack"):
        directory.mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("key")
    (home / "project" / "policy.yaml").write_text("version: 1\n")
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.mark.parametrize("rw_home", [False, True])
def test_a_planned_layout_holds_the_invariants(real_home: Path, rw_home: bool) -> None:
    """From real files: the masked home, or the home shown with --rw-home, where every listed
    credential is hidden whether it exists or not (one created during the run is hidden too)."""
    home = str(real_home)
    options = SessionOptions(
        policy_file=f"{home}/project/policy.yaml", config_dir=real_home / ".config" / "egressd"
    )
    workdir = home if rw_home else f"{home}/project"
    layout = plan_layout(options, workdir=workdir, rw=[], ro=[], rw_home=rw_home, environ={}, private=())
    profile = seatbelt_profile(layout, PROXY, temp=[TEMP], home=home, marker=MARKER)
    models = _models(profile)
    for rel in CREDENTIALS:
        for path in (f"{home}/{rel}", f"{home}/{rel}/inner"):
            for operation in (*READ_OPERATIONS, "file-write-create", "file-write-data", *EXEC_OPERATIONS):
                assert _denied_under_both(models, operation, path=path), (operation, path)
    for path in _guarded_probes(layout):
        for operation in WRITE_OPERATIONS:
            assert _denied_under_both(models, operation, path=path), (operation, path)
    assert models[0].decide("file-write-create", path=f"{home}/project/new.txt") == "allow"


# -- the run's mark -------------------------------------------------------------------------------
def test_the_runs_mark_tells_its_processes_from_every_other() -> None:
    """What egressd asks the kernel about each process when the run ends: only this run's profile
    answers "mark denied, neighbour allowed" (another run's, an unsandboxed process, an app's own
    deny-everything sandbox do not), so a daemon the child left is found however it detached."""

    def asks(model: Model):  # type: ignore[no-untyped-def]
        return lambda path: model.decide("file-read-data", path=path) == "deny"

    ours = Model.of(_profile())
    another_run = Model.of(_profile(marker=OTHER_MARKER))
    everything = Model.of("(version 1)(deny default)")
    assert leftovers.is_this_run(asks(ours), MARKER)
    assert not leftovers.is_this_run(asks(another_run), MARKER)
    assert not leftovers.is_this_run(asks(everything), MARKER)
    assert not leftovers.is_this_run(lambda path: False, MARKER)  # unsandboxed
    assert not leftovers.is_this_run(lambda path: None, MARKER)  # the kernel would not say


# -- the model itself, held to what has been measured on Macs ---------------------------------------
@pytest.mark.parametrize(
    ("profile", "operation", "path", "expected"),
    [
        # an operation-specific deny is not undone by a later wildcard allow (sandbox-runtime)
        (
            '(deny file-write-unlink (literal "/a"))(allow file-write* (subpath "/"))',
            "file-write-unlink",
            "/a",
            "deny",
        ),
        # a wildcard deny after an operation-specific allow does not take it back (greywall)
        (
            '(allow file-read-data (subpath "/"))(deny file-read* (literal "/a"))',
            "file-read-data",
            "/a",
            "allow",
        ),
        # an unfiltered allow does not undo a filtered deny of its level (mxc)
        ('(deny file-read-data (literal "/a"))(allow file-read-data)', "file-read-data", "/a", "deny"),
        # among filtered rules of one level, the last that matches
        (
            '(deny file-read* (subpath "/a"))(allow file-read* (subpath "/a/b"))',
            "file-read-data",
            "/a/b/c",
            "allow",
        ),
        (
            '(allow file-read* (subpath "/a/b"))(deny file-read* (subpath "/a"))',
            "file-read-data",
            "/a/b/c",
            "deny",
        ),
    ],
)
def test_the_model_follows_the_measured_precedence(
    profile: str, operation: str, path: str, expected: str
) -> None:
    assert Model.of("(version 1)(deny default)" + profile).decide(operation, path=path) == expected


# -- hostile path strings, through a real Scheme reader ---------------------------------------------
NAMES = st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=30).filter(
    lambda s: "/" not in s and s not in (".", "..")
)
PLACEHOLDER = "PLACEHOLDER"


def _substituted(value: object, name: str) -> object:
    if isinstance(value, str):
        return value.replace(PLACEHOLDER, name)
    if isinstance(value, list):
        return [_substituted(v, name) for v in value]
    if isinstance(value, tuple):
        return tuple(_substituted(v, name) for v in value)
    return value


def _reads_back(name: str) -> None:
    expected = [
        Rule(r.action, r.operations, _substituted(r.filters, name), r.modifiers)  # type: ignore[arg-type]
        for r in evaluate(_named(PLACEHOLDER))
    ]
    assert evaluate(_named(name)) == expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(NAMES)
def test_a_hostile_name_reads_back_through_tinyscheme_as_itself(name: str) -> None:
    """Property: tinyscheme reads the profile for any printable name as exactly the rules of a
    placeholder name, each string byte for byte the path given: no name becomes a rule."""
    if 0x7F in (ord(c) for c in name):
        return  # refused by quote(), as test_seatbelt checks
    _reads_back(name)


@pytest.mark.parametrize(
    "name",
    [
        'p") (allow network*) ("',
        'x" #t) (allow default) ("',
        "a\\",
        '\\"',
        ";(allow default)",
        '#"^$"',
        "é日本🦀",
    ],
)
def test_known_hostile_names_change_no_rule(name: str) -> None:
    _reads_back(name)
    rules = evaluate(_named(name))
    assert not any(
        r.action == "allow" and ("default" in r.operations or "network*" in r.operations) for r in rules
    )

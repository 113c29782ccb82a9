"""What a refusal tells a person to change, by reason and by where it is read (the hint context).

Why: a hint that names a command the reader is not running, or an edit that cannot work, sends
people (and the models that read refusals) the wrong way: `egressd exec --allow` under `egressd acp`,
`--allow HOST` for a host a profile narrows, "allow with" after the person denied it for good,
"<CIDR of the address>" instead of the address, "retrying will not help" when the next attempt is
asked again. One table: reason x context -> what the body, the notice and the stderr line say.
"""

from __future__ import annotations

import io
import re

import pytest

from egressd.admission.events import Decided
from egressd.admission.state import asker
from egressd.observe.refusals import RefusalReport
from egressd.policy.reasons import DENIED_ALWAYS, Reason
from egressd.policy.refusal import HintContext, Refusal
from egressd.wire.refusal import allow_sentence, body, notice, short_hint

FILE = "/home/u/proj/egressd.yaml"
EXEC, EXEC_FILE = HintContext("exec"), HintContext("exec", policy_file=FILE)
SANDBOX, SSH, RUN = HintContext("sandbox", policy_file=FILE), HintContext("ssh"), HintContext("run")
ACP, ACP_FILE = HintContext("acp"), HintContext("acp", policy_file=FILE)
MCP = HintContext("mcp run", policy_file=FILE)
GATEWAY, GATEWAY_BARE = HintContext("run", True, FILE), HintContext("run", True)
EVERY = [EXEC, EXEC_FILE, SANDBOX, SSH, RUN, ACP, ACP_FILE, MCP, GATEWAY, GATEWAY_BARE]
NOT_RUN_BY_HAND = [ACP, ACP_FILE, MCP, GATEWAY, GATEWAY_BARE, SANDBOX, SSH, RUN]

ENFORCE = "a.example:443 is not in the allowlist of /home/u/proj/egressd.yaml (mode: enforce)."


def refusal(code: str, host: str = "a.example", port: int = 443, **more: object) -> Refusal:
    detail = str(more.pop("detail", ENFORCE))
    rule = more.pop("rule", "mode: enforce")
    return Refusal(code, detail, host, port, rule, **more)  # type: ignore[arg-type]


# (refusal, context, what the body's hint says, what it must not say)
CASES: list[tuple[str, Refusal, HintContext, list[str], list[str]]] = [
    (
        "exec",
        refusal("not_allowlisted"),
        EXEC,
        ["To allow it, a person can run: egressd exec --allow a.example -- <command>"],
        [],
    ),
    (
        "exec with its policy file",
        refusal("not_allowlisted", port=8443),
        EXEC_FILE,
        ["egressd exec --allow a.example:8443 -- <command>", f"add 'a.example:8443' to allow: in {FILE}"],
        [],
    ),
    (
        "sandbox",
        refusal("not_allowlisted"),
        SANDBOX,
        ["a person can run: egressd sandbox --allow a.example -- <command>", f"allow: in {FILE}"],
        ["egressd exec"],
    ),
    (
        "ssh",
        refusal("not_allowlisted"),
        SSH,
        ["egressd ssh --allow a.example <destination> -- <command>"],
        [],
    ),
    ("run", refusal("not_allowlisted"), RUN, ["a person can run: egressd run --allow a.example"], []),
    (
        "acp",
        refusal("not_allowlisted"),
        ACP_FILE,
        [
            "a person can add --allow a.example to the egressd acp command in the editor's agent settings",
            f"add 'a.example' to allow: in {FILE}; a saved edit applies at once",
        ],
        ["egressd exec", "run:"],
    ),
    (
        "mcp run",
        refusal("not_allowlisted"),
        MCP,
        ["--allow a.example to this server's egressd mcp run command in the MCP client's configuration"],
        ["egressd exec"],
    ),
    (
        "gateway",
        refusal("not_allowlisted"),
        GATEWAY,
        [
            f"the gateway's operator adds 'a.example' to the allow list in {FILE} "
            "(a saved edit applies at once)"
        ],
        ["egressd exec", "a person"],
    ),
    (
        "gateway without a policy file",
        refusal("not_allowlisted"),
        GATEWAY_BARE,
        ["the gateway's operator restarts it with --policy FILE, 'a.example' in that file's allow list"],
        ["egressd exec"],
    ),
    (
        "profile: its allow list, the exact line",
        refusal("profile", rule="profile agent: allow", profile="agent"),
        EXEC_FILE,
        [f"a person can add the line '- a.example' under profiles.agent.allow in {FILE}"],
        ["--allow", "the policy's allow list", "allow: in"],
    ),
    (
        "profile of a gateway client",
        refusal("profile", port=8080, rule="profile ci: allow", profile="ci"),
        GATEWAY,
        [f"the gateway's operator adds the line '- a.example:8080' under profiles.ci.allow in {FILE}"],
        ["--allow"],
    ),
    (
        "profile: its deny rule",
        refusal("profile", rule="profile agent: deny *.example", profile="agent"),
        ACP_FILE,
        [f"remove '*.example' from profiles.agent.deny in {FILE}"],
        ["--allow"],
    ),
    (
        "profile: its ports",
        refusal("profile", port=22, rule="profile agent: ports [443]", profile="agent"),
        EXEC_FILE,
        [f"add 22 to profiles.agent.ports in {FILE}"],
        ["--allow"],
    ),
    (
        "not allowlisted for a child with a profile: the profile may narrow too",
        refusal("not_allowlisted", profile="fetch"),
        MCP,
        [
            "add 'a.example' to allow: (and to profiles.fetch.allow if that profile has an allow list) "
            f"in {FILE}"
        ],
        ["--allow a.example", "egressd mcp run"],
    ),
    (
        "resolved_forbidden: the real addresses, and private.allow",
        refusal(
            "resolved_forbidden",
            "mirror.test",
            rule="allow: mirror.test",
            addresses=("203.0.113.80", "169.254.169.254", "2001:db8::5", "10.1.2.3"),
        ),
        EXEC_FILE,
        [
            "egressd exec --allow 203.0.113.80/32 --allow 2001:db8::5/128 --allow 10.1.2.3/32 -- <command>",
            f"or set private.allow: true in {FILE}",
        ],
        ["CIDR of", "169.254"],  # an always-refused address is never offered
    ),
    (
        "resolved_forbidden through a gateway",
        refusal("resolved_forbidden", "mirror.test", rule="allow: mirror.test", addresses=("198.51.100.7",)),
        GATEWAY,
        ["the gateway's operator adds '198.51.100.7/32' to the allow list", "private.allow: true"],
        ["egressd exec", "CIDR of"],
    ),
    (
        "private address literal",
        refusal("private_address", "10.0.0.5", 80, rule="private.allow: false"),
        EXEC,
        ["egressd exec --allow 10.0.0.5 -- <command>", "private.allow: true"],
        [],
    ),
    (
        "deny always: nothing says how to allow what a person refused for good",
        refusal("ask_refused", "telemetry.test", 8080, rule=DENIED_ALWAYS, detail="denied always by api"),
        EXEC,
        [],
        ["allow", "--allow"],
    ),
    (
        "deny once: the person may change their mind",
        refusal("ask_refused", "telemetry.test", 8080, rule="mode: ask (denied once)"),
        EXEC,
        ["egressd exec --allow telemetry.test:8080"],
        [],
    ),
    (
        "denylist",
        refusal("denylist", rule="deny: *.example"),
        EXEC_FILE,
        [f"the deny rule '*.example' from {FILE}"],
        [],
    ),
    (
        "ports",
        refusal("port", port=22, rule="ports: [443]"),
        EXEC_FILE,
        [f"add 22 to ports: in {FILE}"],
        ["--allow"],
    ),
    (
        "loopback disabled",
        refusal("loopback_disabled", "127.0.0.1", 8080, rule="loopback.allow: false"),
        EXEC_FILE,
        [f"set loopback.allow: true in {FILE}"],
        ["--allow"],
    ),
    (
        "mode off",
        refusal("mode_off", rule="mode: off"),
        EXEC,
        ["egressd exec --mode enforce --allow a.example -- <command>"],
        ["<host>"],
    ),
    (
        "forbidden address",
        refusal("forbidden_address", "169.254.169.254", 80, rule="always refused"),
        EXEC,
        [],
        ["allow"],
    ),
    ("self", refusal("self", "127.0.0.1", 3128, rule="self 127.0.0.1:3128"), EXEC, [], ["allow"]),
    ("secret exfiltration", refusal("secret_exfiltration", rule=None), EXEC, [], ["allow"]),
]


@pytest.mark.parametrize(("name", "refused", "context", "says", "never"), CASES, ids=[c[0] for c in CASES])
def test_hint_by_reason_and_context(
    name: str, refused: Refusal, context: HintContext, says: list[str], never: list[str]
) -> None:
    sentence = allow_sentence(refused, context) or ""
    for text in says:
        assert text in sentence, sentence
    for text in never:
        assert text not in sentence, sentence
    if not says:
        assert sentence == ""


@pytest.mark.parametrize("context", NOT_RUN_BY_HAND, ids=lambda c: f"{c.command}{'-gw' if c.gateway else ''}")
@pytest.mark.parametrize("code", [r.value for r in Reason if r.policy])
def test_no_hint_names_a_command_the_reader_is_not_running(context: HintContext, code: str) -> None:
    refused = Refusal(code, ENFORCE, "a.example", 443, "mode: enforce", context=context)
    text = body(refused) + notice(refused, "a.example:443") + (short_hint(refused) or "")
    assert "egressd exec" not in text, text


def test_the_body_keeps_its_form_under_exec() -> None:
    """The bytes a refused client of `egressd exec` reads stay as they were."""
    refused = Refusal("not_allowlisted", "not on the allowlist", "api.example", 443, "mode: enforce")
    assert body(refused) == (
        "egressd refused the connection to api.example:443.\n"
        "reason: not_allowlisted\n"
        "decided by: mode: enforce\n"
        "detail: not on the allowlist\n"
        "This is a policy decision: retrying, or trying to bypass the proxy, will not help.\n"
        "To allow it, a person can run: egressd exec --allow api.example -- <command>   "
        "(or add 'api.example' to the policy's allow list)\n"
    )


def test_ask_timeout_says_the_next_attempt_is_asked_again() -> None:
    said = body(refusal("ask_timeout", rule="mode: ask (ask_timeout)", detail="nobody answered within 30s"))
    assert "retrying" not in said and "the next attempt is asked again" in said.lower()
    assert "trying to bypass the proxy will not help" in said


def test_no_approver_says_how_to_become_one() -> None:
    said = body(refusal("no_approver", rule="mode: ask", detail="no approver is connected to answer"))
    assert "retrying" not in said
    for way in ("egressd pending --follow", "egressd approve ID", "egressd dashboard", "in a terminal"):
        assert way in said, said


NOTICE_CASES = [
    refusal("not_allowlisted", context=ACP_FILE),
    refusal("mode_off", rule="mode: off", detail="egress is switched off (mode: off).", context=ACP),
    refusal(
        "denylist", rule="deny: a.example", detail="a.example matches deny rule 'a.example'", context=MCP
    ),
    refusal("profile", rule="profile fetch: allow", profile="fetch", context=MCP),
    refusal("dns_error", detail="a.example: no such host (NXDOMAIN)", context=ACP),
    refusal(
        "no_approver", rule="mode: ask", detail="mode is 'ask' and no approver is connected", context=ACP
    ),
]


@pytest.mark.parametrize("refused", NOTICE_CASES, ids=lambda r: r.reason.value)
def test_notices_to_the_model_are_sentences_addressed_to_a_person(refused: Refusal) -> None:
    """An ACP/MCP notice is read by the model: every part one sentence with one full stop, and
    what would allow it is what a person can do, never an instruction to run egressd."""
    text = notice(refused, "GET http://a.example:443/x")
    assert ".)." not in text and ".." not in text and text.endswith("."), text
    assert "(mode: enforce)." in text or refused.reason is not Reason.NOT_ALLOWLISTED
    for command in re.finditer(r"egressd (?:exec|sandbox|acp|mcp|run|ssh|pending|approve|dashboard)\b", text):
        before = text[: command.start()]
        assert "a person" in before.rsplit(". ", 1)[-1].lower(), text  # in a sentence addressed to a person
    assert "To allow it:" not in text


def test_a_network_failure_notice_says_failed() -> None:
    text = notice(refusal("connect_refused", detail="connection refused", context=ACP), "a.example:443")
    assert text.startswith("egressd failed to reach a.example:443: connect_refused.")
    assert "a retry may work" in text and "allow" not in text


def _decided(host: str, port: int, reason: str, rule: str | None, **more: object) -> Decided:
    fields = {"detail": f"{host} refused", **more}
    return Decided(
        "c1", "egressd", fields.pop("profile", None), "request", host, port, False, reason, rule, **fields
    )  # type: ignore[arg-type]


def test_summary_after_deny_always_does_not_say_allow_with() -> None:
    stream = io.StringIO()
    report = RefusalReport(stream, context=EXEC_FILE)
    report.observe(_decided("telemetry.test", 8080, "ask_refused", DENIED_ALWAYS))
    report.observe(_decided("telemetry.test", 8080, "denylist", "deny: telemetry.test:8080"))
    report.observe(_decided("a.example", 443, "not_allowlisted", "mode: enforce"))
    summary = report.summary() or ""
    assert "--allow telemetry.test" not in summary and "--allow telemetry.test" not in stream.getvalue()
    assert summary.endswith(" - allow with: --allow a.example"), summary


def test_summary_names_the_profile_edit_and_the_addresses() -> None:
    report = RefusalReport(io.StringIO(), context=EXEC_FILE)
    report.observe(_decided("b.example", 443, "profile", "profile agent: allow", profile="agent"))
    report.observe(_decided("c.example", 443, "not_allowlisted", "mode: enforce"))
    report.observe(
        _decided("mirror.test", 443, "resolved_forbidden", "allow: mirror.test", resolved=("203.0.113.80",))
    )
    summary = report.summary() or ""
    assert summary.endswith(
        " - allow with: --allow c.example --allow 203.0.113.80/32"
        f"; add the line '- b.example' under profiles.agent.allow in {FILE} (a saved edit applies at once)"
    ), summary


@pytest.mark.parametrize(
    ("client", "profile", "said"),
    [
        ("egressd", None, "the child (no profile)"),
        ("egressd", "agent", "profile agent"),
        ("ci", "narrow", "profile narrow"),
        ("ci", None, "client ci"),
        ("npm[4242]", None, "client npm[4242]"),
        (None, None, "the child (no profile)"),
    ],
)
def test_who_asks_is_said_without_egressd_s_default_username(
    client: str | None, profile: str | None, said: str
) -> None:
    assert asker(client, profile) == said

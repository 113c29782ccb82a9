"""The policy back in its file format: for `egressd policy show` and for pushing a policy elsewhere.

`parse_policy(policy_to_data(p), ...)` gives back an equal policy; a unit test holds that.
"""

from __future__ import annotations

from typing import Any

from .model import Limits, Policy
from .rules import HostRule, RuleSet
from .secrets import secret_to_data


def _rule(rule: HostRule) -> str | dict[str, Any]:
    if not rule.paths and not rule.methods and not rule.exe and not rule.websocket and not rule.private:
        return rule.text
    entry: dict[str, Any] = {"host": rule.text}
    if rule.paths:
        entry["paths"] = list(rule.paths)
    if rule.methods:
        entry["methods"] = list(rule.methods)
    if rule.exe:
        entry["exe"] = list(rule.exe)
    if rule.websocket:
        entry["websocket"] = True
    if rule.private:
        entry["private"] = True
    return entry


def _rules(ruleset: RuleSet) -> list[str | dict[str, Any]]:
    return [_rule(rule) for rule in ruleset.rules]


def nameserver_text(ip: str, port: int) -> str:
    """A `resolver.nameservers` entry as the file format writes it (port 53 left out for IPv4)."""
    host = f"[{ip}]" if ":" in ip else ip
    return host if port == 53 and ":" not in ip else f"{host}:{port}"


def nameservers(policy: Policy) -> list[str]:
    return [nameserver_text(str(ip), port) for ip, port in policy.resolver.nameservers]


def policy_to_data(policy: Policy) -> dict[str, Any]:
    """The policy as plain data in the file format (loadable again)."""
    profiles: dict[str, Any] = {}
    for name, prof in policy.profiles.items():
        entry: dict[str, Any] = {}
        if prof.allow is not None:
            entry["allow"] = _rules(prof.allow)
        entry["deny"] = _rules(prof.deny)
        entry["ports"] = list(prof.ports)
        profiles[name] = entry
    data: dict[str, Any] = {
        "version": policy.version,
        "mode": policy.mode,
        "allow": _rules(policy.allow),
        "deny": _rules(policy.deny),
        "loopback": {"allow": policy.loopback.allow, "ports": list(policy.loopback.ports)},
        "private": {"allow": policy.private.allow, "origins": [str(o) for o in policy.private.origins]},
        "builtin": [
            {
                "host": b.host,
                "paths": list(b.paths),
                "methods": list(b.effective_methods),
                **({"websocket": True} if b.websocket else {}),
            }
            for b in policy.builtin
        ],
        "inspect": _rules(policy.inspect),
        "ports": list(policy.ports),
        "credentials": {"strip_on_host_change": list(policy.credentials.strip_on_host_change)},
        "limits": {
            "connect_timeout": policy.limits.connect_timeout,
            "dns_timeout": policy.limits.dns_timeout,
            "idle_timeout": policy.limits.idle_timeout,
            "max_response_bytes": policy.limits.max_response_bytes,
            "header_timeout": policy.limits.header_timeout,
            "max_connections": policy.limits.max_connections,
            "requests_per_second": policy.limits.requests_per_second,
            "burst": policy.limits.burst,
        },
        "resolver": {"nameservers": nameservers(policy)},
        "profiles": profiles,
        "websocket": policy.websocket,
        "refusal_pages": policy.refusal_pages,
        "ask_timeout": policy.ask_timeout,
        "secrets": [secret_to_data(spec) for spec in policy.secrets],
        "audit": {"on_failure": policy.audit.on_failure, "max_queue_bytes": policy.audit.max_queue_bytes},
    }
    if policy.limits.response_timeout != Limits().response_timeout:
        # the other timeouts keep their older spelling above, and this one is written only when set:
        # a remote egressd that predates `timeouts:` still loads a pushed policy that does not use it
        data["timeouts"] = {"response": policy.limits.response_timeout}
    parent = policy.upstream_proxy
    if parent is not None:  # where its credentials are, never what they are
        url_host = f"[{parent.host}]" if ":" in parent.host else parent.host
        entry = {"url": f"http://{url_host}:{parent.port}", "direct": _rules(parent.direct)}
        entry["connect_by"] = parent.connect_by
        if parent.credentials_env is not None:
            entry["credentials_env"] = parent.credentials_env
        if parent.credentials_file is not None:
            entry["credentials_file"] = parent.credentials_file
        data["upstream_proxy"] = entry
    if policy.preset is not None:
        preset = policy.preset
        data["preset"] = {"name": preset.name, "version": preset.version}
        data["preset"].update({k: v for k, v in (("summary", preset.summary), ("sends", preset.sends)) if v})
    if policy.providers:
        data["providers"] = [
            {
                "name": ack.name,
                "version": ack.version,
                "acknowledged": ack.acknowledged,
                "hosts": list(ack.hosts),
                "added": list(ack.added),
            }
            for ack in policy.providers
        ]
    return data

"""egressd between an agent host and what it runs: ACP (`egressd acp`) and MCP (`egressd mcp`).

`jsonrpc` relays newline-delimited JSON-RPC between two byte streams and lets a protocol rewrite
the few messages it must; `acp` and `mcp_run` are those protocols' rules; `mcp_config` rewrites
the MCP configuration files of Claude Desktop, Claude Code, VS Code and Cursor.
"""

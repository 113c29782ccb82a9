"""The tools that write policies, off every connection's path: a rule edited in place
(`policy_edit`), provider presets (`providers`), `policy suggest`, `policy import`
(`importers`) and `policy export` (`export`).
"""

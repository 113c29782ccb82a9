"""What a child of egressd gets and runs with: its environment (`env`), the fixes for clients
that need more than the proxy variables (`client_fixes`), its SSH command (`ssh_env`), the
process that carries its signals and exit status (`process`), the CONNECT helper it runs as
an SSH ProxyCommand (`connect`) and its side of `exec --attach` (`attach`).
"""

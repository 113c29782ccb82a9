"""What egressd needs of the machine, and none of its rules: atomic files and their one watcher
(`files`, `reload`), its own listeners (`listeners`), exit statuses and signals (`exits`),
the host's interfaces (`interfaces`), the owner of a socket (`peer`, and `diag`: the sock_diag
socket of a child's namespace), the descriptor budget (`descriptors`), waiting on a raw descriptor
(`fdwait`) and the loggers made on their first message (`log`).
"""

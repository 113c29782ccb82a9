"""What egressd needs of the machine, and none of its rules: atomic files and their one watcher
(`files`, `reload`), its own listeners (`listeners`), exit statuses and signals (`exits`),
the host's interfaces (`interfaces`), the owner of a socket (`peer`), the descriptor budget
(`descriptors`) and waiting on a raw descriptor (`fdwait`).
"""

"""Remote hosts over SSH: `egressd ssh` runs a command on a remote machine under the client's policy.

Two modes share one SSH connection layout (an OpenSSH control master plus multiplexed sessions):

* relay (default): the remote child's proxy variables point at a loopback port on the remote that
  the session's guard holds and relays to a Unix-socket reverse forward leading back to the
  client's proxy, so every request is decided by the local policy and leaves from the client;
* remote egress: `egressd remote-agent` runs on the remote, receives the client's policy over the
  SSH connection (at connect and on every change) and the traffic leaves from the remote.

Modules: `destination` (DESTINATION parsing), `sshargs` (pure argv building), `scripts` (the
remote sh snippets), `spawn` (local processes with the right signal mask), `connection` (the
master and its multiplexed commands), `supervise` (waiting, signals, SSH drops), `relay` and
`interfaces` (the client's own addresses), `channel`/`push`/`remote_egress` (client side of remote
egress), `feeder`/`agent` (remote side), `reaper` (the session's guard, on the remote in both
modes: holds the ports the command connects to and ends everything it started when the session
ends).
"""

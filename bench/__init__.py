"""egressd's benchmark against its peers (issue 7): run with `.venv/bin/python bench/run.py`.

Modules by concern: `config` (sizes), `system` (installs, network namespace, pinning, /proc stats),
`certs` (the bench's own CA), `upstream` (nginx and the Python sink/echo servers), `peers` (direct,
tinyproxy, Squid, mitmproxy, srt, egressd; the sandbox workloads' wrappers), `loadgen` (the load
generators), `workloads` (the thirteen workloads), `sandbox_client` (the client run inside each
wrapper in workloads 10-13), `npmjob` (the local npm registry and the real job), `decision` (workload
8, run in its own process), `report` (JSON, markdown, PNG).
"""

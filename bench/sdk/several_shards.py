"""One 1 KiB publish at a time through the standard SDK (felix-client), round robin
over K streams (one shard each) from one connection: does core affinity hold when a
connection publishes to several shards, and what does it cost? Prints ack p50/p99, the
broker's CPU per ack and the share of publishes that crossed cores.

    python several_shards.py ADDR HTTP TOKEN_FILE CA_FILE BROKER_PID K [N] [WARMUP_S]

HTTP is the broker's metrics address (host:port). The warm-up publishes for WARMUP_S
seconds (default 6) first, so that load following (docs/architecture.md) has moved
what it will. Cross-core publishes are the count of `felix_broker_mesh_hop_seconds`
over the measured run. docs/benchmarks.md has results.
"""
import os
import sys
import time
import urllib.request

import felix

addr, http, token_path, ca = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
pid, k = int(sys.argv[5]), int(sys.argv[6])
n = int(sys.argv[7]) if len(sys.argv) > 7 else 6000
warmup = float(sys.argv[8]) if len(sys.argv) > 8 else 6.0
c = felix.Client(addr, tenant_id="dev", token=open(token_path).read().strip(), ca_file=ca)
payload = b"x" * 1024
streams = [f"several-{i}" for i in range(k)]


def hops():
    text = urllib.request.urlopen(f"http://{http}/metrics").read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("felix_broker_mesh_hop_seconds_count")
    )


def cpu_seconds():
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


i = 0
end = time.perf_counter() + warmup
while time.perf_counter() < end:
    c.publish("dev", "default", streams[i % k], payload, ack="per_message")
    i += 1

lat = []
h0, c0, t0 = hops(), cpu_seconds(), time.perf_counter()
for i in range(n):
    s = time.perf_counter()
    c.publish("dev", "default", streams[i % k], payload, ack="per_message")
    lat.append((time.perf_counter() - s) * 1e6)
wall, c1, h1 = time.perf_counter() - t0, cpu_seconds(), hops()
lat.sort()
print(
    f"streams={k} n={n} p50={lat[n // 2]:.0f}us p99={lat[int(n * 0.99)]:.0f}us "
    f"rate={n / wall:.0f}/s broker_cpu_per_ack={(c1 - c0) / n * 1e6:.0f}us "
    f"crossed_cores={(h1 - h0) / n:.0%}"
)

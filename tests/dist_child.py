"""One process of the multi-process tests (tests/test_distributed.py starts several of these).

usage: python tests/dist_child.py MODE PORT NUM_PROCESSES PROCESS_ID CPU_DEVICES CKPT OUT_DIR
  MODE logits: load CKPT sharded (fsdp over every device of every process), run the forward on
               OUT_DIR/tokens.npy, process 0 writes OUT_DIR/logits.npy.
  MODE memory: load CKPT sharded and write OUT_DIR/mem<id>.json with the peak memory of the load.
"""
import json
import os
import sys
import threading
import time

mode, port, nproc, pid, ndev, ckpt, out = sys.argv[1:8]
os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(ndev))  # before anything touches the backend
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from amdllm.io import checkpoint  # noqa: E402
from amdllm.parallel import distributed, sharding


def status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM, RssAnon, RssFile)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


info = distributed.initialize(f"127.0.0.1:{port}", int(nproc), int(pid), timeout_s=60)
assert info["global_devices"] == int(nproc) * int(ndev), info
mesh = sharding.make_mesh("fsdp=-1")

if mode == "memory":
    anon0, rss0 = status("RssAnon"), status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS, so it measures the load alone
    peak = [anon0]
    stop = threading.Event()

    def sample():  # RssAnon has no high-water mark of its own: sample it
        while not stop.is_set():
            peak[0] = max(peak[0], status("RssAnon"))
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    model = checkpoint.load(ckpt, mesh=mesh, rules="fsdp")
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    stop.set()
    t.join()
    owned = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards)
    res = {"anon_peak_delta": peak[0] - anon0, "hwm_delta": status("VmHWM") - rss0, "owned": owned,
           "anon_after": status("RssAnon") - anon0, "file_after": status("RssFile")}
    with open(os.path.join(out, f"mem{pid}.json"), "w") as f:
        json.dump(res, f)
else:
    from amdllm.model import forward, to_pure
    model = checkpoint.load(ckpt, mesh=mesh, rules="fsdp")
    top, layers = to_pure(model)
    tokens = np.load(os.path.join(out, "tokens.npy"))
    per = tokens.shape[0] // int(nproc)
    x = distributed.global_batch(tokens[int(pid) * per:(int(pid) + 1) * per], mesh)  # this process's rows
    logits = jax.jit(lambda t, l, x: forward(model.cfg, t, l, x)[0])(top, layers, x)
    full = distributed.gather(logits)
    if int(pid) == 0:
        np.save(os.path.join(out, "logits.npy"), full)
distributed.shutdown()
print(f"process {pid}: ok", flush=True)

"""Solutions to the exercises of 02_mesh_sharding.ipynb. Run: python notebooks/solutions/02_mesh_sharding.py"""
import jax

jax.config.update("jax_num_cpu_devices", 8)

from amdllm.io import checkpoint  # noqa: E402
from amdllm import course
from amdllm.parallel import plan, sharding
from amdllm.config import get_preset  # noqa: E402

cfg = checkpoint.load(course.default_model_dir()).cfg
devices, note = sharding.mesh_devices(8)  # the accelerators where there are 8, else simulated CPU devices
print(note)

# 1. Weight bytes per device for each rules preset on 8 devices.
for rules, mesh in (("fsdp", "fsdp=8"), ("tp", "tensor=2,data=4"), ("fsdp_tp", "fsdp=4,tensor=2"), ("dp", "data=8")):
    try:
        rows = sharding.sharding_table(cfg, sharding.make_mesh(mesh, devices=devices), rules)
        print(f"1. {rules:<8} on {mesh:<16} {sum(r['bytes_per_device'] for r in rows) / 1e6:7.2f} MB of weights per device")
    except sharding.ShardingError as e:
        print(f"1. {rules:<8} on {mesh:<16} impossible: {e}")
print("   dp needs no weight communication (every device has everything) but holds 8x the memory;"
      " fsdp holds the least and all-gathers each layer's weights in every step.")

# 2. A mesh the model cannot use: tensor=8 with 2 key/value heads.
try:
    sharding.make_mesh("tensor=8", devices=devices, cfg=cfg, rules="tp")
except sharding.ShardingError as e:
    print("2.", e)

# 3. The smallest number of MI300X for Llama 3.1 70B LoRA (rank 16, batch 8, seq 4096, bf16).
c70 = get_preset("llama-3.1-70b")
for remat in (False, True):
    for n in (1, 2, 4, 8, 16):
        p = plan.plan(c70, devices=n, device_memory_gb=192, mesh=f"fsdp={n}", rules="fsdp", lora_rank=16,
                      batch_size=8, seq_len=4096)
        if p["fits_remat" if remat else "fits"]:
            total = p["total_gb_remat" if remat else "total_gb"]
            print(f"3. {'with' if remat else 'without'} remat: {n} MI300X ({total:.0f} GB per device)")
            break
    else:  # activations of 8 x 4096 tokens without remat do not shrink with fsdp: no count fits
        print(f"3. {'with' if remat else 'without'} remat: does not fit on up to 16 MI300X "
              f"({p['total_gb']:.0f} GB per device at 16); use remat or a smaller batch per device")

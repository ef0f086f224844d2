"""Solutions to the exercises of 04_gptq_quantization.ipynb. Run: python notebooks/solutions/04_gptq_quantization.py"""
import json

from amdllm.io import checkpoint
from amdllm import course, quant
from amdllm.infer import evaluate
from amdllm.io.tokenizer import load_tokenizer

model_dir = course.default_model_dir()
tok = load_tokenizer(model_dir)
heldout = tok(course.heldout_text_path().read_text())["input_ids"]
corpus = tok((course.data_dir() / "corpus_train.txt").read_text())["input_ids"]
windows = quant.calibration_windows(corpus, 32, 256, seed=0)


def ppl(spec, method="gptq", calib=windows, report=False):
    m, rows = quant.quantize_model(checkpoint.load(model_dir), calib, spec, method=method, progress=False,
                                  report=report)
    p = evaluate.perplexity(m, heldout, progress=False)["perplexity"]
    return (p, quant.model_bytes(m), sum(r["gptq_err"] for r in rows)) if report else (p, quant.model_bytes(m))


# 1. Act-order at 3 bits.
for act in (False, True):
    print(f"1. 3-bit GPTQ act_order={act}: perplexity {ppl(quant.QuantSpec(bits=3, act_order=act))[0]:.3f}")

# 2. Group size at 3 bits: GPTQ's summed output error separates the sizes most clearly (perplexity on a
#    well-trained small model moves in the third decimal). Bytes: 3-bit is held as dense fake-quantized
#    weights, so they are the same for every group size here; on disk, `paper_bytes` gives the cost.
cfg = checkpoint.load(model_dir).cfg
for g in (-1, 64, 32):
    p, _, err = ppl(quant.QuantSpec(bits=3, group_size=g), report=True)
    print(f"2. group {g:>4}: output error {err:8.2f}, perplexity {p:.4f}, "
          f"{quant.paper_bytes(cfg, 3, g)['total_bytes'] / 1e6:.2f} MB on paper")

# 3. Calibrate on the task data instead of the stories.
task_text = "\n".join(" ".join(json.loads(l).values()) for l in course.task_paths()[0].read_text().splitlines())
task_windows = quant.calibration_windows(tok(task_text)["input_ids"], 32, 256, seed=0)
print(f"3. story calibration {ppl(quant.QuantSpec(bits=3))[0]:.3f} vs task calibration "
      f"{ppl(quant.QuantSpec(bits=3), calib=task_windows)[0]:.3f} (perplexity on held-out stories, 3-bit)")

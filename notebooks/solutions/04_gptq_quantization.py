"""Solutions to the exercises of 04_gptq_quantization.ipynb. Run: python notebooks/solutions/04_gptq_quantization.py"""
import json

from amdllm import checkpoint, course, evaluate, gptq
from amdllm.tokenizer import load_tokenizer

model_dir = course.default_model_dir()
tok = load_tokenizer(model_dir)
heldout = tok(course.heldout_text_path().read_text())["input_ids"]
corpus = tok((course.data_dir() / "corpus_train.txt").read_text())["input_ids"]
windows = gptq.calibration_windows(corpus, 32, 256, seed=0)


def ppl(spec, method="gptq", calib=windows):
    m, _ = gptq.quantize_model(checkpoint.load(model_dir), calib, spec, method=method, progress=False, report=False)
    return evaluate.perplexity(m, heldout, progress=False)["perplexity"], gptq.model_bytes(m)


# 1. Act-order at 3 bits.
for act in (False, True):
    print(f"1. 3-bit GPTQ act_order={act}: perplexity {ppl(gptq.QuantSpec(bits=3, act_order=act))[0]:.3f}")

# 2. Group size at 4 bits (bytes: the model as held in memory, packed).
for g in (-1, 128, 32):
    p, b = ppl(gptq.QuantSpec(bits=4, group_size=g))
    print(f"2. group {g:>4}: perplexity {p:.3f}, {b / 1e6:.2f} MB")

# 3. Calibrate on the task data instead of the stories.
task_text = "\n".join(" ".join(json.loads(l).values()) for l in course.task_paths()[0].read_text().splitlines())
task_windows = gptq.calibration_windows(tok(task_text)["input_ids"], 32, 256, seed=0)
print(f"3. story calibration {ppl(gptq.QuantSpec(bits=3))[0]:.3f} vs task calibration "
      f"{ppl(gptq.QuantSpec(bits=3), calib=task_windows)[0]:.3f} (perplexity on held-out stories, 3-bit)")

"""Standard evaluation and calibration sets (`--dataset`, `--protocol gptq`) against the GPTQ paper's
procedure, written out below as its `datautils.py` and `llama.py` do it (the tokenizer called on the
joined text, python's `random` seeded once, transformers computing each window's loss), on small local
datasets in the layouts users have: a `save_to_disk` wikitext-like set and C4-like `json.gz` shards.
No network: HF_HUB_OFFLINE=1 (tests/conftest.py)."""
import gzip
import json
import math
import random

import numpy as np
import pytest

from tests.robustness.conftest import TEXT, amdllm, one_line_error
from tests.robustness.conftest import tiny  # noqa: F401,F811  (a fixture, used by name)

L = 32  # the window (seqlen); the tiny model's context is 128
WORDS = TEXT.split()


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """A wikitext-like DatasetDict on disk and a C4-like shard layout."""
    import datasets
    root = tmp_path_factory.mktemp("sets")
    rng = random.Random(7)
    splits = {}
    for name, n in (("train", 60), ("validation", 20), ("test", 40)):
        rows = []
        for k in range(n):  # wikitext's shape: headings, blank rows, paragraphs
            rows += [f" = Heading {k} = \n", "", sentence(rng, rng.randint(5, 60)) + " \n"]
        splits[name] = datasets.Dataset.from_dict({"text": rows})
    wiki = root / "wikitext2"
    datasets.DatasetDict(splits).save_to_disk(str(wiki))
    c4 = root / "c4"
    (c4 / "en").mkdir(parents=True)
    for fname, n in (("c4-train.00000-of-01024.json.gz", 300), ("c4-validation.00000-of-00008.json.gz", 1200)):
        with gzip.open(c4 / "en" / fname, "wt") as f:
            for k in range(n):  # short and long documents, as C4 has: many are under one window
                f.write(json.dumps({"text": sentence(rng, rng.choice([3, 8, 20, 45, 90])),
                                    "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.com/{k}"}) + "\n")
    return {"wiki": wiki, "c4": c4, "splits": splits}


def c4_texts(sets, split):
    fname = {"train": "c4-train.00000-of-01024.json.gz", "validation": "c4-validation.00000-of-00008.json.gz"}
    with gzip.open(sets["c4"] / "en" / fname[split], "rt") as f:
        return [json.loads(line)["text"] for line in f]


# ---- the reference procedure (GPTQ datautils.py / llama.py), with the checkpoint's transformers tokenizer
def ref_wikitext2_test(tok, texts):
    testenc = tok("\n\n".join(texts))["input_ids"]
    nsamples = len(testenc) // L
    return [testenc[i * L:(i + 1) * L] for i in range(nsamples)]


def ref_c4_validation(tok, valdata):
    valenc = tok(" ".join(valdata[:1100]))["input_ids"][:256 * L]
    return [valenc[i * L:(i + 1) * L] for i in range(len(valenc) // L)]


def ref_c4_train(tok, traindata, nsamples, seed):
    random.seed(seed)
    trainloader = []
    for _ in range(nsamples):
        while True:
            i = random.randint(0, len(traindata) - 1)
            trainenc = tok(traindata[i])["input_ids"]
            if len(trainenc) > L:
                break
        i = random.randint(0, len(trainenc) - L - 1)
        trainloader.append(trainenc[i:i + L])
    return trainloader


def ref_wikitext2_train(tok, texts, nsamples, seed):
    trainenc = tok("\n\n".join(texts))["input_ids"]
    random.seed(seed)
    out = []
    for _ in range(nsamples):
        i = random.randint(0, len(trainenc) - L - 1)
        out.append(trainenc[i:i + L])
    return out


def ref_perplexity(model_dir, wins):
    """llama.py's llama_eval: each window's mean shifted cross-entropy, times seqlen, summed; exp of the sum
    over nsamples * seqlen."""
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    nlls = []
    with torch.no_grad():
        for w in wins:
            batch = torch.tensor([w])
            logits = model(batch).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1, :].reshape(-1, logits.shape[-1]),
                                                     batch[:, 1:].reshape(-1))
            nlls.append(loss.float() * L)
    return math.exp(float(torch.stack(nlls).sum() / (len(wins) * L)))


def test_gptq_eval_windows_and_perplexity_equal_the_reference(tiny, sets):
    from amdllm.infer.evaluate import perplexity_of_windows
    from amdllm.infer.protocols import eval_windows
    from amdllm.io.checkpoint import load
    from amdllm.io.hfdata import load_texts
    from amdllm.io.tokenizer import encoder, load_tokenizer
    tok, enc = load_tokenizer(tiny["model"]), encoder(tiny["model"])
    texts, info = load_texts(str(sets["wiki"]), None)
    assert info["split"] == "test" and texts == sets["splits"]["test"]["text"]
    ours, rep = eval_windows(texts, enc, L, "gptq", "wikitext2")
    ref = ref_wikitext2_test(tok, texts)
    assert [w.tolist() for w in ours] == ref and rep["windows"] == len(ref) and rep["dropped_tokens"] > 0
    model = load(tiny["model"])
    ppl = perplexity_of_windows(model, ours, progress=False)["perplexity"]
    assert ppl == pytest.approx(ref_perplexity(tiny["model"], ref), rel=1e-5)

    val, info = load_texts(str(sets["c4"]), None)
    assert info["split"] == "validation" and val == c4_texts(sets, "validation")
    ours, rep = eval_windows(val, enc, L, "gptq", "c4")
    ref = ref_c4_validation(tok, val)
    assert [w.tolist() for w in ours] == ref and rep["windows"] == 256  # the 1,100 documents hold > 256 x L


@pytest.mark.parametrize("seed", [0, 3])
def test_gptq_calibration_windows_equal_the_reference(tiny, sets, seed):
    from amdllm.infer.protocols import calib_windows
    from amdllm.io.hfdata import load_texts
    from amdllm.io.tokenizer import encoder, load_tokenizer
    tok, enc = load_tokenizer(tiny["model"]), encoder(tiny["model"])
    train, info = load_texts(str(sets["c4"]), None, default_splits=("train",))
    assert info["split"] == "train"
    ours, rep = calib_windows(train, enc, 16, L, seed, "gptq", "c4")
    assert ours.tolist() == ref_c4_train(tok, train, 16, seed) and rep["documents_drawn"] > 16  # short ones skipped
    wiki, _ = load_texts(str(sets["wiki"]), "train")
    ours, _ = calib_windows(wiki, enc, 16, L, seed, "gptq", "wikitext2")
    assert ours.tolist() == ref_wikitext2_train(tok, wiki, 16, seed)


def test_cli_eval_and_quantize_on_local_sets(tiny, sets, tmp_path):
    """`amdllm quantize --dataset <C4 layout> --protocol gptq`, then `amdllm eval --dataset` of the result by
    both protocols; the fp model's gptq-protocol perplexity equals the reference's."""
    from amdllm.io.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny["model"])

    def ev(model, *extra):
        p = amdllm("eval", "--model", model, "--dataset", sets["wiki"], "--seq-len", L, "--json", *extra)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout)

    fp = ev(tiny["model"], "--protocol", "gptq")
    assert (fp["protocol"], fp["rule"], fp["split"], fp["dataset"]) == ("gptq", "wikitext2", "test", str(sets["wiki"]))
    ref = ref_wikitext2_test(tok, sets["splits"]["test"]["text"])
    assert fp["windows"] == len(ref) and fp["tokens"] == len(ref) * (L - 1)
    assert fp["perplexity"] == pytest.approx(ref_perplexity(tiny["model"], ref), rel=1e-4)
    ours = ev(tiny["model"])  # the default protocol keeps the last partial window
    assert ours["protocol"] == "amdllm" and ours["tokens"] > fp["tokens"]

    out = tmp_path / "q4"
    p = amdllm("quantize", "--model", tiny["model"], "--out", out, "--dataset", sets["c4"], "--protocol", "gptq",
               "--samples", 16, "--seq-len", L, "--group-size", 32, "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    cal = json.loads(p.stdout)["calibration"]
    assert (cal["protocol"], cal["rule"], cal["split"], cal["samples"]) == ("gptq", "c4", "train", 16)
    q = {proto: ev(out, "--protocol", proto)["perplexity"] for proto in ("gptq", "amdllm")}
    print(f"\nfp: gptq {fp['perplexity']:.4f}, amdllm {ours['perplexity']:.4f}; "
          f"GPTQ 4-bit g32 calibrated on C4-like (gptq protocol): gptq {q['gptq']:.4f}, amdllm {q['amdllm']:.4f}")
    assert all(np.isfinite(v) for v in q.values())


def test_dataset_errors_are_one_line(tiny, sets, tmp_path):
    m = tiny["model"]
    one_line_error(amdllm("eval", "--model", m, "--dataset", tmp_path / "nowhere"), "nowhere", "no such file")
    one_line_error(amdllm("eval", "--model", m, "--dataset", "wikitext2", env={"HF_HOME": str(tmp_path / "hf")}),
                   "wikitext2", "HF_HUB_OFFLINE")
    one_line_error(amdllm("eval", "--model", m, "--dataset", sets["wiki"], "--column", "body"), "'body'",
                   "['text']")
    one_line_error(amdllm("eval", "--model", m, "--dataset", sets["wiki"], "--split", "dev"), "'dev'",
                   "['train', 'validation', 'test']")
    one_line_error(amdllm("quantize", "--model", m, "--out", tmp_path / "q", "--dataset", sets["c4"], "--split",
                          "test"), "'test'", "train")
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "the cat"}\n')
    one_line_error(amdllm("eval", "--model", m, "--dataset", short, "--protocol", "gptq"), "too few for one window")
    one_line_error(amdllm("quantize", "--model", m, "--out", tmp_path / "q", "--dataset", short, "--protocol",
                          "gptq", "--seq-len", 32), "a calibration window needs more than 32")
    assert not (tmp_path / "q").exists()


def test_local_files_json_lines_gzip_and_parquet(sets, tmp_path):
    """The file layouts besides save_to_disk and C4: JSON lines (plain and .gz), parquet, and a directory
    of them, each read as its single split 'train' with the column asked for."""
    import datasets

    from amdllm.io.hfdata import DatasetError, load_texts
    rows = sets["splits"]["test"]
    (tmp_path / "d").mkdir()
    rows.to_json(str(tmp_path / "d" / "a.jsonl"))
    rows.to_parquet(str(tmp_path / "b.parquet"))
    datasets.Dataset.from_dict({"body": rows["text"]}).to_json(str(tmp_path / "c.jsonl"))
    with open(tmp_path / "d" / "a.jsonl", "rb") as f, gzip.open(tmp_path / "e.jsonl.gz", "wb") as g:
        g.write(f.read())
    for spec, column in ((tmp_path / "d", "text"), (tmp_path / "b.parquet", "text"), (tmp_path / "c.jsonl", "body"),
                         (tmp_path / "e.jsonl.gz", "text")):
        texts, info = load_texts(str(spec), None, column)
        assert texts == rows["text"] and info["split"] == "train", spec
    with pytest.raises(DatasetError, match="one split, 'train'"):
        load_texts(str(tmp_path / "b.parquet"), "test")

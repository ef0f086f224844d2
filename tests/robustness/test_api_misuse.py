"""Class "API misuse": the Python functions a notebook calls, given the wrong kind of argument, say what
they expected (a TypeError or ValueError naming the argument), never an XLA error or silent garbage."""
import math

import numpy as np
import pytest


@pytest.fixture(scope="module")
def loaded(tiny):
    from amdllm.io.checkpoint import load
    from amdllm.io.tokenizer import load_tokenizer
    return load(tiny["model"]), load_tokenizer(tiny["model"]), tiny["model"]


def cases(model, tok, path):
    from amdllm.infer.evaluate import evaluate_text, perplexity
    from amdllm.infer.generate import Decoder, generate, generate_ids
    from amdllm.io.peft import save_adapter
    from amdllm.model.lora import apply_lora
    from amdllm.quant.calibrate import quantize_model
    from amdllm.train.data import Dataset
    from amdllm.train.loop import finetune
    ids = tok("the cat sat on the mat")["input_ids"]
    V = model.cfg.vocab_size
    return {
        "generate: a path for the model": (lambda: generate(str(path), tok, "the cat"), TypeError,
                                           "expected an amdllm Llama model (a path"),
        "generate: None for the tokenizer": (lambda: generate(model, None, "the cat"), TypeError,
                                             "expected a tokenizer"),
        "generate: token ids for the prompt": (lambda: generate(model, tok, ids), TypeError, "generate_ids"),
        "generate_ids: text for the ids": (lambda: generate_ids(model, "the cat"), TypeError,
                                           "list of prompts"),
        "generate_ids: strings in the ids": (lambda: generate_ids(model, [["the", "cat"]]), TypeError, "text"),
        "generate_ids: an id beyond the vocabulary": (lambda: generate_ids(model, [[1, V + 5]]), ValueError,
                                                      f"token id {V + 5} is outside"),
        "generate_ids: a negative id": (lambda: generate_ids(model, [[-1, 4]]), ValueError, "token id -1"),
        "generate_ids: max_new_tokens -5": (lambda: generate_ids(model, [ids], -5), ValueError, "max_new_tokens"),
        "generate_ids: temperature nan": (lambda: generate_ids(model, [ids], 4, temperature=math.nan),
                                          ValueError, "temperature"),
        "generate_ids: top_p nan": (lambda: generate_ids(model, [ids], 4, top_p=math.nan), ValueError, "top_p"),
        "Decoder: a path": (lambda: Decoder(str(path)), TypeError, "expected an amdllm Llama model"),
        "perplexity: text for the ids": (lambda: perplexity(model, "the cat sat"), TypeError, "text"),
        "perplexity: a path for the model": (lambda: perplexity(path, ids), TypeError, "(a path"),
        "perplexity: batch_size 0": (lambda: perplexity(model, ids, batch_size=0), ValueError, "batch_size"),
        "perplexity: seq_len beyond the context": (lambda: perplexity(model, ids, seq_len=10**6), ValueError,
                                                   "max_position_embeddings"),
        "perplexity: float ids": (lambda: perplexity(model, np.array([1.5, 2.0])), TypeError, "integer"),
        "evaluate_text: ids for the text": (lambda: evaluate_text(model, tok, ids), TypeError, "expected text"),
        "evaluate_text: None for the tokenizer": (lambda: evaluate_text(model, None, "the cat"), TypeError,
                                                  "expected a tokenizer"),
        "apply_lora: a path": (lambda: apply_lora(str(path)), TypeError, "apply_lora"),
        "save_adapter: a path": (lambda: save_adapter(str(path), "/tmp/never"), TypeError, "save_adapter"),
        "quantize_model: a path": (lambda: quantize_model(str(path), None, None), TypeError, "quantize_model"),
        "finetune: a path": (lambda: finetune(str(path), Dataset(*[np.zeros((1, 4), np.int32)] * 5), "/tmp/never"),
                             TypeError, "finetune"),
    }


CASES = ["generate: a path for the model", "generate: None for the tokenizer", "generate: token ids for the prompt",
         "generate_ids: text for the ids", "generate_ids: strings in the ids",
         "generate_ids: an id beyond the vocabulary", "generate_ids: a negative id",
         "generate_ids: max_new_tokens -5", "generate_ids: temperature nan", "generate_ids: top_p nan",
         "Decoder: a path", "perplexity: text for the ids", "perplexity: a path for the model",
         "perplexity: batch_size 0", "perplexity: seq_len beyond the context", "perplexity: float ids",
         "evaluate_text: ids for the text", "evaluate_text: None for the tokenizer", "apply_lora: a path",
         "save_adapter: a path", "quantize_model: a path", "finetune: a path"]


@pytest.mark.parametrize("case", CASES)
def test_says_what_was_expected(case, loaded):
    fn, exc, words = cases(*loaded)[case]
    with pytest.raises(exc) as e:
        fn()
    assert words in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) == 1

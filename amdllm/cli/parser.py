"""The `amdllm` command line, declared in one place: every subcommand's flags, their types and defaults.

This module imports nothing but the standard library (and `amdllm.__version__`), so that a flag error or
`--help` answers at once: the command modules import JAX, flax and the model (seconds), and
`amdllm.cli.main` imports only the one the parsed command names (`COMMANDS`). The flags' vocabularies are
therefore written out here; tests/test_cli.py checks each against the library's own table.
"""
from __future__ import annotations

import argparse
import math

from amdllm import __version__

# subcommand -> the module under amdllm.cli whose `run(args)` does the work (`eval` is a builtin's name)
COMMANDS = {"doctor": "doctor", "eval": "evaluate", "generate": "generate", "finetune": "finetune", "plan": "plan",
            "quantize": "quantize", "serve": "serve", "convert": "convert"}

# the library's vocabularies (tests/test_cli.py: each equals the table named beside it)
DTYPE_CHOICES = ("auto", "float32", "bfloat16")   # amdllm.infer.generate.DTYPE_CHOICES (and finetune)
CONVERT_DTYPES = ("bfloat16", "float16", "float32")  # amdllm.io.convert.DTYPES
RULES = ("dp", "fsdp", "fsdp_tp", "tp")           # amdllm.parallel.sharding.RULES
DEFAULT_RULES = "fsdp_tp"                         # amdllm.parallel.sharding.DEFAULT_RULES
PROTOCOLS = ("amdllm", "gptq")                    # amdllm.infer.protocols.PROTOCOLS
TOO_LONG = ("split", "truncate", "drop")          # amdllm.train.data.TOO_LONG
ACCELERATORS = ("mi300x", "mi325x", "mi250x", "h100", "h200", "a100",  # amdllm.parallel.plan.PEAK_BF16_TFLOPS
                "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e")
PLAN_DTYPES = ("float32", "bfloat16", "float16", "int8")  # amdllm.parallel.plan.DTYPE_BYTES


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: the flag at fault and what was expected (argparse prints the whole
    usage block first; `--help` still shows it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="amdllm", description="Fine-tune and quantize Llama models with JAX.")
    p.add_argument("--version", action="version", version=f"amdllm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)  # subcommand parsers are Parsers too
    for add in (_doctor, _eval, _generate, _finetune, _plan, _quantize, _serve, _convert):
        add(sub)
    return p


# --------------------------------------------------------------------------------------------------
# Argument types and the flags several commands share
# --------------------------------------------------------------------------------------------------
def count(minimum: int = 1, maximum: int | None = None):
    """argparse type: an integer in [minimum, maximum] (so --batch-size 0 is refused by name, before any
    work)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < minimum or (maximum is not None and v > maximum):
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}"
                                             + ("" if maximum is None else f" and <= {maximum}") + f", got {v}")
        return v
    return parse


SEED_MAX = 2**32 - 1  # a seed every generator takes (JAX's keys, numpy's)


def number(minimum: float | None = None, maximum: float | None = None, *, above: bool = False):
    """argparse type: a finite float in [minimum, maximum] ((minimum, maximum] with above=True)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = minimum is None or (v > minimum if above else v >= minimum)
        if not math.isfinite(v) or not low_ok or (maximum is not None and v > maximum):
            bounds = ([] if minimum is None else [f"{'>' if above else '>='} {minimum:g}"]) + \
                     ([] if maximum is None else [f"<= {maximum:g}"])
            raise argparse.ArgumentTypeError(f"expected a finite number {' and '.join(bounds)}, got {text}")
        return v
    return parse


def add_pickle_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-pickle", action="store_true",
                   help="read pickled pytorch_model*.bin weights (tensors only, with torch.load("
                        "weights_only=True)); for sources you trust. `amdllm convert` rewrites them once")


def add_model_args(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    p.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory to apply")
    add_pickle_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    if dtype:
        p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")


def add_run_shape_args(p: argparse.ArgumentParser, *, plan: bool = False) -> None:
    """The options that set a LoRA run's memory and work: `finetune` and `plan` share them, names and
    defaults, so that a plan is the run it describes."""
    p.add_argument("--rank", "--lora-rank", dest="rank", type=count(0 if plan else 1), default=8,
                   help="LoRA rank" + (" (0: plan inference, no training)" if plan else ""))
    p.add_argument("--targets", default="q,k,v,o,gate,up,down", help="LoRA target projections")
    p.add_argument("--batch-size", type=count(), default=8,
                   help="rows per micro-batch, split over the mesh's data and fsdp axes")
    p.add_argument("--grad-accum", type=count(), default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=count(2), default=None,
                   help="tokens per row (default: 256, or the model's context where that is shorter)")
    p.add_argument("--mesh", default=None,
                   help="mesh spec, e.g. fsdp=8 or data=2,fsdp=8 (default: every device on fsdp when >1)")
    p.add_argument("--rules", default=None, choices=RULES,
                   help=f"sharding rules preset (amdllm.parallel.sharding; default {DEFAULT_RULES})")
    p.add_argument("--remat", nargs="?", const="full", default="none", choices=("none", "dots", "full", "auto"),
                   help="what the backward recomputes: full (the flag alone: each layer from its input, least "
                        "memory), dots (keep the projections' outputs, recompute the rest), auto (the least "
                        "recompute the plan fits), none (default)")


def add_dataset_args(p: argparse.ArgumentParser, source, *, what: str, default_split: str,
                     protocol_help: str) -> None:
    """`--dataset` joins the mutually exclusive `source` group (beside --text or --calib)."""
    source.add_argument("--dataset", default=None,
                        help=f"{what}, by Hub name (wikitext2, c4, NAME[:CONFIG]) or local path (save_to_disk "
                             "directory, JSON/JSON-lines/parquet files, a C4 shard layout)")
    p.add_argument("--split", default=None, help=f"the dataset's split (default: {default_split})")
    p.add_argument("--column", default="text", help="the dataset's text column (default: text)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="amdllm", help=protocol_help)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes (one per host; docs/cli.md, 'Several processes')")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0 (default: JAX_COORDINATOR_ADDRESS, SLURM or Open MPI)")
    g.add_argument("--num-processes", type=count(), default=None, help="processes in the run (one per host)")
    g.add_argument("--process-id", type=count(0), default=None, help="this process's id, 0..N-1")
    g.add_argument("--init-timeout", type=count(), default=300,
                   help="seconds to wait for every process to join (default 300)")
    g.add_argument("--heartbeat-timeout", type=count(), default=100,
                   help="seconds without news from a process before the others stop (default 100)")


# --------------------------------------------------------------------------------------------------
# The subcommands (docs/cli.md documents each flag)
# --------------------------------------------------------------------------------------------------
def _doctor(sub) -> None:
    p = sub.add_parser("doctor", help="backend, devices, memory, versions and set-up warnings")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of a text or a dataset (protocols: docs/cli.md)")
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", default=None, help="UTF-8 text file (default: the held-out course text)")
    add_dataset_args(p, src, what="a dataset", default_split="test, else validation",
                     protocol_help="amdllm (default: every token, last partial window kept) or gptq (the GPTQ "
                                   "paper's code: full windows only; C4: 1,100 documents, 256 windows)")
    p.add_argument("--seq-len", type=count(2), default=None,
                   help="window length in tokens (default 256, or the model's context if shorter)")
    p.add_argument("--batch-size", type=count(), default=8, help="windows per forward pass")
    p.add_argument("--mesh", default=None, help="load the weights split over this mesh (e.g. fsdp=8): each "
                   "device reads only its blocks (default: one device)")
    p.add_argument("--rules", default=None, choices=RULES,
                   help=f"sharding rules preset with --mesh (default {DEFAULT_RULES})")


def _generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (greedy or top-p sampling)")
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="prompt text, tokenized as tokenizer(prompt)")
    p.add_argument("--max-new-tokens", type=count(0), default=64)
    p.add_argument("--temperature", type=number(0), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=number(0, 1, above=True), default=1.0)
    p.add_argument("--seed", type=count(0, SEED_MAX), default=0)


def _finetune(sub) -> None:
    p = sub.add_parser("finetune", help="LoRA fine-tuning; writes a PEFT adapter (and optionally a merged model)")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    add_pickle_arg(p)
    p.add_argument("--chat-template", default=None, help="for chat rows: llama3, llama2, vicuna or a Jinja "
                   "file (default: the tokenizer's own, else a built-in format); saved with the adapter")
    p.add_argument("--data", required=True, help="JSONL: Alpaca, chat (messages) or plain (text) rows")
    p.add_argument("--eval-data", default=None, help="held-out JSONL (loss, and exact match for Alpaca rows)")
    p.add_argument("--out", required=True, help="output directory (adapter, metrics.jsonl, checkpoints/)")
    p.add_argument("--steps", type=count(), default=100)
    add_run_shape_args(p)
    p.add_argument("--alpha", type=number(0, above=True), default=16)
    p.add_argument("--dropout", type=number(0, 0.99), default=0.0)
    p.add_argument("--lr", type=number(0), default=2e-4)
    p.add_argument("--warmup", type=count(0), default=None)
    p.add_argument("--weight-decay", type=number(0), default=0.0)
    p.add_argument("--clip", type=number(0), default=1.0)
    p.add_argument("--no-pack", action="store_true", help="one example per row (padding) instead of packing")
    p.add_argument("--too-long", choices=TOO_LONG, default="split",
                   help="an example longer than --seq-len: split into windows (each token still trained once), "
                        "truncate, or drop; the run's data stats count each and the tokens lost")
    p.add_argument("--seed", type=count(0, SEED_MAX), default=0)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="frozen base weights and compute (auto: bfloat16 on accelerators; on a CPU a bfloat16 "
                        "checkpoint stays bfloat16 and the step computes in float32); LoRA and AdamW stay float32")
    p.add_argument("--device-memory", type=number(0, above=True), default=None,
                   help="GB one device may use, for the plan's check (default: the device's limit; on a CPU the "
                        "available host memory over the local devices)")
    p.add_argument("--log-every", type=count(), default=1)
    p.add_argument("--eval-every", type=count(0), default=0)
    p.add_argument("--save-every", type=count(0), default=0)
    p.add_argument("--keep", type=count(), default=2)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out (an earlier adapter); its checkpoints still need --resume")
    p.add_argument("--merge", action="store_true", help="also write OUT/merged/, a merged HF checkpoint")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (each process prints its own)")
    add_cluster_args(p)


def _plan(sub) -> None:
    p = sub.add_parser("plan", help="memory per device, FLOPs per token and MFU for a model on a mesh")
    p.add_argument("--model", default=None, help="a preset (e.g. llama-3.1-405b) or an HF checkpoint directory")
    p.add_argument("--devices", type=count(), default=8)
    p.add_argument("--accelerator", default="mi300x", help="sets --device-memory and the MFU peak: "
                   + ", ".join(ACCELERATORS) + ", cpu")
    p.add_argument("--device-memory", type=number(0, above=True), default=None,
                   help="GB per device (default: the accelerator's)")
    add_run_shape_args(p, plan=True)
    p.add_argument("--full-finetune", action="store_true", help="plan full fine-tuning instead")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--dtype", default="auto", choices=("auto", *PLAN_DTYPES),
                   help="frozen weights and compute (auto: bfloat16, what finetune uses on an accelerator)")
    p.add_argument("--bits", type=int, choices=(2, 4, 8), default=None,
                   help="a GPTQ-packed base (QLoRA): projections at this many bits (default: a GPTQ --model "
                        "directory's own; otherwise unquantized)")
    p.add_argument("--group-size", type=int, default=None,
                   help="GPTQ group size with --bits (default: the directory's, else 128; -1: one group)")
    p.add_argument("--fewest-devices", action="store_true",
                   help="also find the fewest devices (an fsdp=N mesh, the rules' batch split) on which this "
                        "run fits, without remat and with --remat dots and full")
    p.add_argument("--tokens-per-second", type=number(0, above=True), default=None,
                   help="also report the MFU this implies")
    p.add_argument("--json", action="store_true")


def _quantize(sub) -> None:
    p = sub.add_parser("quantize", help="GPTQ/RTN 4-bit quantization into a GPTQ checkpoint dir",
                       description="Quantize a Llama checkpoint to GPTQ format (HF/GPTQModel layout).")
    p.add_argument("--model", help="HF checkpoint dir (default: the embedded course model)")
    add_pickle_arg(p)
    p.add_argument("--out", required=True, help="output directory (new or empty; never --model)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--method", choices=("gptq", "rtn"), default="gptq")
    p.add_argument("--bits", type=int, default=4, help="2, 4 or 8 (default 4)")
    p.add_argument("--group-size", type=int, default=128, help="-1 (per channel), 16..1024 (default 128)")
    p.add_argument("--act-order", action="store_true", help="desc_act: columns by decreasing diag(H)")
    p.add_argument("--static-groups", action="store_true", help="group params from the original weights")
    p.add_argument("--act-group-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQModel's GAR: solve groups by importance, g_idx stays in order (default on)")
    p.add_argument("--mse", action=argparse.BooleanOptionalAction, default=True,
                   help="search each group's grid range for the least rounding error, as the reference's "
                        "mse option does (default on; --no-mse: the plain min-max grid)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--sym", dest="sym", action="store_true", default=True, help="symmetric grid (default)")
    g.add_argument("--asym", dest="sym", action="store_false", help="asymmetric grid (saved as gptq_v2)")
    p.add_argument("--damp", type=number(0, 1, above=True), default=0.01,
                   help="percdamp (default 0.01, raised if needed)")
    p.add_argument("--no-true-sequential", action="store_true")
    p.add_argument("--compare-rtn", action="store_true",
                   help="also report RTN's output error per projection (one more [out, in] x [in, in] product each)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--calib", help="calibration text file (default: the course corpus)")
    add_dataset_args(p, src, what="calibration dataset", default_split="train",
                     protocol_help="amdllm (default: random windows of the joined text) or gptq (the GPTQ "
                                   "paper's code: C4, one random window in each of --samples random long "
                                   "documents)")
    p.add_argument("--samples", type=count(), default=128)
    p.add_argument("--seq-len", type=count(2), default=None,
                   help="tokens per calibration window (default: 256, or the model's context where shorter)")
    p.add_argument("--seed", type=count(0, SEED_MAX), default=0)
    p.add_argument("--json", action="store_true")


def _serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    p.add_argument("--model", default=None, help="HF checkpoint directory, full or GPTQ (default: the embedded model)")
    p.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory to apply")
    add_pickle_arg(p)
    p.add_argument("--chat-template", default=None, help="llama3, llama2, vicuna or a Jinja file (default: "
                   "the adapter's chat_template.jinja, else the tokenizer's own, else a built-in format)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and "
                   "/openapi.json (/health and the chat page / stay open: they show no data)")
    p.add_argument("--max-batch", type=count(), default=8, help="requests decoded together (cache rows)")
    p.add_argument("--max-tokens-cap", type=count(), default=512, help="largest max_tokens a request may ask for")
    p.add_argument("--max-context", type=count(2), default=None,
                   help="cache length per request (default: the model's context, at most 4096)")
    p.add_argument("--model-name", default=None, help="the id in /v1/models (default: the directory name)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    p.add_argument("--request-timeout", type=number(0, above=True), default=None,
                   help="seconds a client has to send a whole request, from its first byte (default 30); "
                        "a connection that sends nothing or trickles is closed")
    p.add_argument("--max-connections", type=count(), default=None,
                   help="open connections at most (default 512); more are closed at once")


def _convert(sub) -> None:
    p = sub.add_parser("convert", help="rewrite a checkpoint (pickled .bin, SentencePiece, delta weights) as "
                                       "safetensors + tokenizer.json")
    p.add_argument("--model", required=True, help="source checkpoint directory (with --delta-base: the delta)")
    p.add_argument("--out", required=True, help="new directory (refused if it exists and is not empty)")
    add_pickle_arg(p)
    p.add_argument("--dtype", choices=CONVERT_DTYPES, default=None,
                   help="stored dtype (default: the source's; float16 when applying a delta)")
    p.add_argument("--delta-base", default=None,
                   help="base checkpoint the --model delta weights apply to (FastChat's apply_delta rule)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

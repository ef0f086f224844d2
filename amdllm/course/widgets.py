"""ipywidgets for the course notebooks: where the learner should play.

Each helper returns an object with a `.widget` to display and plain methods that do the same work
without a browser (`ChatBox.send`, `MemoryExplorer.update`), so a headless run of a notebook
exercises exactly the code a click would.
"""
from __future__ import annotations

import html
from typing import Callable

import ipywidgets as W
from IPython.display import display

from amdllm.config import PRESETS
import amdllm.course.plots as plots
from amdllm.parallel import plan as plan_mod
from amdllm.parallel.sharding import RULES


class ChatBox:
    """A small chat UI over `respond(history: list[(role, text)], message) -> reply text`."""

    def __init__(self, respond: Callable[[list, str], str], title: str = "chat with the model",
                 placeholder: str = "Type a prompt and press Enter"):
        self.respond = respond
        self.history: list[tuple[str, str]] = []
        self.log = W.HTML(value=self._render(), layout=W.Layout(border="1px solid #ccc", padding="6px",
                                                                  max_height="320px", overflow_y="auto"))
        self.box = W.Text(placeholder=placeholder, layout=W.Layout(width="70%"))
        self.button = W.Button(description="Send", button_style="primary")
        self.clear = W.Button(description="Clear")
        self.status = W.Label()
        self.button.on_click(lambda _: self._on_send())
        self.clear.on_click(lambda _: self.reset())
        self.box.on_submit(lambda _: self._on_send())  # Enter in the text box
        self.widget = W.VBox([W.HTML(f"<b>{html.escape(title)}</b>"), self.log,
                              W.HBox([self.box, self.button, self.clear]), self.status])

    def _render(self) -> str:
        if not self.history:
            return "<i>(no messages yet)</i>"
        rows = []
        for role, text in self.history:
            color = "#1f77b4" if role == "you" else "#2ca02c"
            rows.append(f"<div><b style='color:{color}'>{role}:</b> {html.escape(text)}</div>")
        return "\n".join(rows)

    def send(self, message: str) -> str:
        """Send one message (what the button does) and return the model's reply."""
        reply = self.respond(list(self.history), message)
        self.history += [("you", message), ("model", reply)]
        self.log.value = self._render()
        return reply

    def _on_send(self):
        message = self.box.value.strip()
        if not message:
            return
        self.box.value = ""
        self.status.value = "generating..."
        try:
            self.send(message)
            self.status.value = ""
        except Exception as e:  # show it in the UI: an exception in a callback is otherwise invisible
            self.status.value = f"error: {type(e).__name__}: {e}"

    def reset(self):
        self.history = []
        self.log.value = self._render()

    def _ipython_display_(self):
        display(self.widget)


class MemoryExplorer:
    """Pick a model, accelerator, mesh, batch, sequence and LoRA rank -> memory per device (amdllm.parallel.plan)."""

    def __init__(self, extra_models: dict | None = None, **initial):
        self.plan_mod = plan_mod
        self.models = {**(extra_models or {}), **PRESETS}  # name -> LlamaConfig
        self.last: dict | None = None
        self.text, self.figure = "", None  # the latest result, for snapshot()
        self._quiet = False  # set while update() changes several controls: refresh once at the end
        dd = lambda opts, value, desc: W.Dropdown(options=opts, value=value, description=desc,
                                                  style={"description_width": "90px"})
        self.controls = {
            "model": dd(list(self.models), initial.get("model", "llama-3.1-8b"), "model"),
            "accelerator": dd(list(plan_mod.DEVICE_MEMORY_GB), initial.get("accelerator", "mi300x"), "accelerator"),
            "devices": dd([1, 2, 4, 8, 16, 32, 64, 128], initial.get("devices", 8), "devices"),
            "mesh": W.Text(value=initial.get("mesh", "auto"), description="mesh",
                           style={"description_width": "90px"}, continuous_update=False),
            "rules": dd(list(RULES), initial.get("rules", "fsdp"), "rules"),
            "batch_size": dd([1, 2, 4, 8, 16, 32, 64, 128, 256], initial.get("batch_size", 8), "batch"),
            "seq_len": dd([64, 256, 512, 1024, 2048, 4096, 8192], initial.get("seq_len", 2048), "sequence"),
            "lora_rank": dd([0, 4, 8, 16, 32, 64], initial.get("lora_rank", 8), "LoRA rank"),
            "dtype": dd(["bfloat16", "float32"], initial.get("dtype", "bfloat16"), "dtype"),
            "remat": dd(["none", "dots", "full"], self.plan_mod.remat_mode(initial.get("remat", "none")), "remat"),
        }
        self.out = W.Output()
        for c in self.controls.values():
            c.observe(lambda _: None if self._quiet else self._refresh(), names="value")
        c = list(self.controls.values())
        self.widget = W.VBox([W.HBox([W.VBox(c[:5]), W.VBox(c[5:])]), self.out])
        self._refresh()

    def update(self, **settings) -> dict:
        """Set some controls (same names as the constructor) and recompute; returns the plan dict."""
        unknown = set(settings) - set(self.controls)
        if unknown:
            raise ValueError(f"MemoryExplorer.update: unknown setting(s) {sorted(unknown)}; known: {', '.join(self.controls)}")
        self._quiet = True
        try:
            for k, v in settings.items():
                self.controls[k].value = self.plan_mod.remat_mode(v) if k == "remat" else v
        finally:
            self._quiet = False
        self._refresh()
        return self.last

    def _refresh(self):
        s = {k: c.value for k, c in self.controls.items()}
        self.out.clear_output(wait=True)
        with self.out:
            try:
                p = self.plan_mod.plan(self.models[s["model"]], devices=s["devices"],
                                       device_memory_gb=self.plan_mod.DEVICE_MEMORY_GB[s["accelerator"]],
                                       mesh=s["mesh"], rules=s["rules"], lora_rank=s["lora_rank"],
                                       batch_size=s["batch_size"], seq_len=s["seq_len"], dtype=s["dtype"])
            except ValueError as e:  # an indivisible mesh etc.: the planner's message says what would work
                self.last = None
                print(f"cannot plan this: {e}")
                return
            self.last = p
            g = p["per_device_gb"]
            key = self.plan_mod.remat_key(s["remat"])
            parts = {"weights": g["weights"], "LoRA": g["lora"], "optimizer": g["optimizer"], "gradients":
                     g["gradients"], "activations" + (f" (remat {s['remat']})" if key else ""): g["activations" + key]}
            total = p["total_gb" + key]
            self.text = (f"{s['model']}: {p['params'] / 1e9:.2f}B parameters, {p['mode']}, mesh "
                         + ",".join(f"{a}={n}" for a, n in p["mesh"].items() if n > 1)
                         + f", {p['batch_per_device']} sequence(s) per device; total {total:.1f} GB of "
                         f"{p['device_memory_gb']:g} GB")
            self.figure = plots.memory_breakdown(parts, capacity_gb=p["device_memory_gb"],
                                                 title=f"{s['accelerator']} x{s['devices']}")
            print(self.text)
            display(self.figure)

    def snapshot(self):
        """The current result outside the widget: prints the summary line and returns the figure. A saved
        or rendered notebook (nbconvert, GitHub) keeps no widget output, but it keeps this."""
        print(self.text if self.last is not None else "cannot plan these settings")
        return self.figure if self.last is not None else None

    def _ipython_display_(self):
        display(self.widget)

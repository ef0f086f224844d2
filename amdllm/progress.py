"""Progress bars: tqdm's widget in a live notebook, text elsewhere. The course runner sets
AMDLLM_TEXT_PROGRESS=1 for its headless kernels: a saved notebook cannot keep a widget's last state (it
shows "0%"), while a text bar's output ends with its final line, which the runner keeps."""
import os

if os.environ.get("AMDLLM_TEXT_PROGRESS") == "1":
    from tqdm import tqdm  # noqa: F401
else:
    from tqdm.auto import tqdm  # noqa: F401

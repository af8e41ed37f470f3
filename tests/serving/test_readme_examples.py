"""The deepseek recipe's serving guide (SERVING.md): its Python examples for tool calling, structured output and
/v1/responses, run as written against `bash recipes/deepseek/run.sh --serve` on the served tiny checkpoint (only the
port differs): the guide stays true."""
import contextlib
import io
import re
import subprocess
from pathlib import Path

import pytest

from serving_harness import free_port
from test_serve_subprocess import RUN_SH, wait_healthy

README = Path(__file__).resolve().parents[2] / "recipes" / "deepseek" / "docs" / "SERVING.md"
SECTIONS = ("## Tool calling and structured output", "## /v1/responses")


def python_blocks(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(section + "\n")
    end = text.find("\n## ", start + len(section))
    return re.findall(r"```python\n(.*?)```", text[start: end if end > 0 else None], flags=re.S)


@pytest.mark.slow
def test_the_readme_examples_answer(checkpoint):
    blocks = {s: python_blocks(s) for s in SECTIONS}
    assert all(blocks.values()), "an example block went missing from the README"
    port = free_port()
    proc = subprocess.Popen(["bash", str(RUN_SH), "--serve", "--port", str(port), "--weights", str(checkpoint),
                             "--exe-mode", "eager", "--dtype", "fp32", "--served-model-name", "deepseek-v4-tiny"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 120)
        for section, codes in blocks.items():
            for code in codes:
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    exec(compile(code.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), section, "exec"), {})
                assert out.getvalue().strip(), f"the example under {section} printed nothing"
                if section == SECTIONS[0]:
                    first = out.getvalue().splitlines()[0]
                    assert first.startswith("tool_calls get_weather {"), first  # the forced call, parsed
    finally:
        proc.terminate()
        proc.communicate(timeout=30)

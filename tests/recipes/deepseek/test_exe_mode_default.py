"""Which execution mode a command line runs where none is named: auto with --weights (graph where a bucket's graph
beats eager, as vLLM compiles by default), eager on the tiny random checkpoint and where no graph can run."""
import pytest

import generate
import serve
from tiny_deepseek_v4 import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("exe-mode") / "ckpt", seed=3)


def test_a_checkpoint_runs_auto_and_the_tiny_demo_eager(ckpt):
    assert generate.parse_args(["--weights", str(ckpt)]).exe_mode == "auto"
    assert serve.parse_args(["--weights", str(ckpt)]).exe_mode == "auto"
    assert generate.parse_args([]).exe_mode == "eager"
    assert serve.parse_args([]).exe_mode == "eager"


def test_a_named_mode_wins_over_the_default(ckpt, tmp_path):
    assert generate.parse_args(["--weights", str(ckpt), "--exe-mode", "eager"]).exe_mode == "eager"
    assert generate.parse_args(["--exe-mode", "graph"]).exe_mode == "graph"
    preset = tmp_path / "graph.yaml"
    preset.write_text("exe_mode: graph\nengine: {max_num_seqs: 4}\n")
    assert generate.parse_args(["--weights", str(ckpt), "--config", str(preset)]).exe_mode == "graph"
    assert generate.parse_args(["--weights", str(ckpt), "--config", str(preset),
                                "--exe-mode", "auto"]).exe_mode == "auto"


def test_counting_routes_defaults_to_eager_and_host_experts_on_cpu_to_auto(ckpt, tmp_path):
    counts = tmp_path / "counts.json"
    assert generate.parse_args(["--weights", str(ckpt), "--record-routing", str(counts)]).exe_mode == "eager"
    a = generate.parse_args(["--weights", str(ckpt), "--offload-experts", "2"])
    assert a.offload is not None and a.exe_mode == "auto"  # on CPU the graph calls the host experts

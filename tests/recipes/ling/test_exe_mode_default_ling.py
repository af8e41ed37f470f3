"""Ling's command lines run auto where no mode is named and a checkpoint is given, eager on the tiny demo."""
import generate_ling
import serve_ling


def test_a_checkpoint_runs_auto_and_the_tiny_demo_eager(tmp_path):
    assert generate_ling.parse_args(["--weights", str(tmp_path)]).exe_mode == "auto"
    assert serve_ling.parse_args(["--weights", str(tmp_path)]).exe_mode == "auto"
    assert generate_ling.parse_args([]).exe_mode == "eager"
    assert generate_ling.parse_args(["--weights", str(tmp_path), "--exe-mode", "graph"]).exe_mode == "graph"

"""The publisher's pickled ckpts/ layout converts to the safetensors folders the recipe loads, tensors unchanged."""
import pytest
import torch
from convert_checkpoint_hunyuan_video import main as convert_main
from safetensors.torch import load_file
from tiny_hunyuan_video import MODEL_DIR, write_tiny_checkpoint

from common.loader import Checkpoint


def tensors(folder):
    ckpt = Checkpoint(folder)
    return {name: ckpt.get(name) for name in ckpt.names()}


def test_publisher_pickles_convert_to_the_same_tensors(tmp_path):
    root = write_tiny_checkpoint(tmp_path / "ckpts")
    dit, vae = root / MODEL_DIR / "transformers", root / MODEL_DIR / "vae"
    want_dit, want_vae = tensors(dit), load_file(vae / "model.safetensors")
    for folder in (dit, vae):  # what the publisher ships: pickles, no safetensors
        for f in folder.glob("model*.safetensors*"):
            f.unlink()
    torch.save({"module": want_dit, "epoch": 3}, dit / "mp_rank_00_model_states.pt")
    torch.save({f"vae.{k}": v for k, v in want_vae.items()}, vae / "pytorch_model.pt")
    assert convert_main([str(root)]) == 0
    got_dit, got_vae = tensors(dit), tensors(vae)
    assert got_dit.keys() == want_dit.keys() and got_vae.keys() == want_vae.keys()
    assert all(torch.equal(got_dit[k], want_dit[k]) for k in want_dit)
    assert all(torch.equal(got_vae[k], want_vae[k]) for k in want_vae)


def test_missing_pickle_is_an_error(tmp_path, capsys):
    (tmp_path / MODEL_DIR / "transformers").mkdir(parents=True)
    assert convert_main([str(tmp_path)]) == 2
    assert "mp_rank_00_model_states.pt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_main(["--key", "bogus", str(tmp_path)])

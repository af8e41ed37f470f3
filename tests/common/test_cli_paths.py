"""The rule for relative path arguments: the caller's folder first, then the recipe folder; outputs: the caller's."""
import argparse

import pytest

from common.cli_paths import CALLER_DIR_ENV, caller_dir, input_path, output_path


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    caller, recipe = tmp_path / "caller", tmp_path / "recipe"
    (caller / "configs").mkdir(parents=True)
    (recipe / "configs").mkdir(parents=True)
    monkeypatch.setenv(CALLER_DIR_ENV, str(caller))
    monkeypatch.chdir(recipe)  # where run.sh's cd leaves the script
    return caller, recipe


def test_caller_dir_is_what_run_sh_recorded_else_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(CALLER_DIR_ENV, str(tmp_path / "somewhere"))
    assert caller_dir() == tmp_path / "somewhere"
    monkeypatch.delenv(CALLER_DIR_ENV)
    monkeypatch.chdir(tmp_path)
    assert caller_dir() == tmp_path


def test_input_found_from_the_caller(dirs):
    caller, recipe = dirs
    (caller / "configs" / "mine.yaml").write_text("a: 1\n")
    assert input_path(recipe)("configs/mine.yaml") == caller / "configs" / "mine.yaml"


def test_input_in_both_folders_is_the_callers(dirs):
    caller, recipe = dirs
    for d in (caller, recipe):
        (d / "configs" / "tiny.yaml").write_text("a: 1\n")
    assert input_path(recipe)("configs/tiny.yaml") == caller / "configs" / "tiny.yaml"


def test_input_only_in_the_recipe_folder_is_the_recipes(dirs):
    caller, recipe = dirs
    (recipe / "configs" / "tiny.yaml").write_text("a: 1\n")
    assert input_path(recipe)("configs/tiny.yaml") == recipe / "configs" / "tiny.yaml"
    (recipe / "ckpt").mkdir()  # folders too (--weights)
    assert input_path(recipe)("ckpt") == recipe / "ckpt"


def test_input_in_neither_folder_names_the_callers_path(dirs):
    caller, recipe = dirs
    assert input_path(recipe)("configs/nope.yaml") == caller / "configs" / "nope.yaml"


def test_input_parent_references_resolve_from_the_caller(dirs):
    caller, recipe = dirs
    (caller.parent / "shared.yaml").write_text("a: 1\n")
    assert input_path(recipe)("../shared.yaml").resolve() == caller.parent / "shared.yaml"


def test_absolute_paths_are_unchanged(dirs):
    caller, recipe = dirs
    (recipe / "configs" / "tiny.yaml").write_text("a: 1\n")
    for path in (recipe / "configs" / "tiny.yaml", caller / "nope.yaml"):
        assert input_path(recipe)(str(path)) == path
        assert output_path(str(path)) == path


def test_output_is_from_the_caller_even_where_the_recipe_has_it(dirs):
    caller, recipe = dirs
    (recipe / "out.png").write_bytes(b"")
    assert output_path("out.png") == caller / "out.png"
    assert output_path("sub/video.mp4") == caller / "sub" / "video.mp4"


def test_as_argparse_types(dirs):
    caller, recipe = dirs
    (recipe / "configs" / "tiny.yaml").write_text("a: 1\n")
    p = argparse.ArgumentParser()
    p.add_argument("--config", type=input_path(recipe), default=recipe / "configs" / "tiny.yaml")
    p.add_argument("--output", type=output_path)
    a = p.parse_args(["--config", "configs/tiny.yaml", "--output", "image.png"])
    assert (a.config, a.output) == (recipe / "configs" / "tiny.yaml", caller / "image.png")
    assert p.parse_args([]).config == recipe / "configs" / "tiny.yaml"  # a Path default is not re-resolved


@pytest.mark.parametrize("kind", ["input", "output"])
def test_empty_path_is_an_argument_error(dirs, kind, capsys):
    p = argparse.ArgumentParser(prog="run.sh")
    p.add_argument("--path", type=input_path(dirs[1]) if kind == "input" else output_path)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--path", ""])
    assert e.value.code == 2 and "argument --path: empty path" in capsys.readouterr().err

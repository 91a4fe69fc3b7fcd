"""store.model_ids: a base model's name is a folder a filesystem takes, at most as deep as the roots are
listed, and never leaves its root."""

from __future__ import annotations

from pathlib import Path

from store.model_ids import MAX_ROOT_DEPTH, NAME_MAX, base_model_dir, base_models, is_safe_name


def test_names_are_bounded_like_the_folders_they_name() -> None:
    assert is_safe_name("org/" + "m" * NAME_MAX)
    assert not is_safe_name("m" * (NAME_MAX + 1)) and not is_safe_name("org/" + "m" * (NAME_MAX + 1))
    assert is_safe_name("/".join(["a"] * MAX_ROOT_DEPTH)) and not is_safe_name(
        "/".join(["a"] * (MAX_ROOT_DEPTH + 1))
    )
    assert not any(is_safe_name(n) for n in ("", "../x", "a/../b", "/abs", "a//b", ".hidden"))


def test_a_name_past_name_max_is_no_model_not_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "org" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert base_model_dir([tmp_path], "org/m") == folder
    assert base_model_dir([tmp_path], "m" * 300) is None  # the filesystem would say "File name too long"
    assert base_models([tmp_path]) == {"org/m": folder}

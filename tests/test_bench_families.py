"""The benchmark families' one interface: every module of bench/families/ declares a
FAMILY the runner finds, and `python -m bench --only` takes exactly their names."""

import importlib
import json
import sys
import types

import pytest

from bench.__main__ import parse_options
from bench.runner import family as family_module
from bench.runner.family import Family, family_modules, found_families, runs
from bench.runner.plan import SIZE_NAMES, Size, Sizes


def test_every_family_module_declares_the_interface():
    modules = family_modules()
    assert len(modules) >= 16 and family_module.SHARED not in modules, modules
    for name in modules:
        family = getattr(importlib.import_module(f"bench.families.{name}"), "FAMILY", None)
        assert isinstance(family, Family) and family.name.replace("-", "_") == name, (name, family)
        assert isinstance(family.sizes, Sizes) and family.measures.strip() and callable(family.run), name
        assert all(isinstance(family.sizes.at(size), Size) for size in SIZE_NAMES), name
    assert sorted(name.replace("-", "_") for name in found_families()) == modules


def test_only_takes_exactly_the_families_found():
    names = tuple(found_families())
    assert parse_options([]).only == names  # every family, in run order
    for name in names:
        assert parse_options(["--only", name]).only == (name,)
    with pytest.raises(SystemExit):
        parse_options(["--only", "no-such-family"])
    # What each name runs: the family itself first, then those it names, all found.
    assert all(run[0].name == name and len(run) == 1 + len(found_families()[name].then) for name, run in runs().items())


def test_the_runs_json_entries_come_from_the_families(monkeypatch):
    # Each optional library missing (no import: the checks of what is installed are
    # patched), so that every entry shows, the reasons for the skips included.
    for module, check in (("transformers", "transformers_unavailable"), ("inference", "generate_unavailable"),
                          ("video", "diffusers_unavailable")):  # fmt: skip
        monkeypatch.setattr(importlib.import_module(f"bench.families.{module}"), check, lambda: "ImportError: none")
    entries = {}
    for family in found_families().values():
        entries.update(family.metadata())
    assert None not in entries.values(), entries
    json.dumps(entries)  # the run's JSON takes them as they are
    expected = {"ring_reference", "usp_baseline", "variants_baseline", "hybrid_baseline", "varlen_baseline",
                "varlen_layouts", "loss_baseline", "memory_baseline", "transformers_baseline",
                "transformers_skipped", "inference_baseline", "inference_generate_skipped", "video_baseline",
                "video_skipped", "sparse_baseline"}  # fmt: skip
    assert set(entries) == expected, sorted(set(entries) ^ expected)


def test_a_module_without_family_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "bench.families.unfinished", types.ModuleType("bench.families.unfinished"))
    monkeypatch.setattr(family_module, "family_modules", lambda: ["unfinished"])
    with pytest.raises(ValueError, match=r"bench/families/unfinished\.py must declare FAMILY"):
        found_families.__wrapped__()


def test_a_malformed_family_is_named():
    sizes = found_families()["reshard"].sizes
    with pytest.raises(ValueError, match=r"'extra': timed_share must be within \[0, 1\], got 1.5"):
        Family(name="extra", order=1, measures="m", run=print, sizes=sizes, timed_share=1.5)
    with pytest.raises(ValueError, match=r"'extra' names itself"):
        Family(name="extra", order=1, measures="m", run=print, sizes=sizes, then=("extra",))

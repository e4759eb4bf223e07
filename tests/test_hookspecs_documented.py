"""Meta-tests: every hook spec is documented, in the hook-order test, and
exercised by a test (datasette's ``test_plugin_hooks_have_tests``); hook
registration is strict."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError
from fedaval.plugin_manager import get_plugin_manager, load_plugins, spec_names

ROOT = Path(__file__).resolve().parents[1]
SPECS = spec_names()


def test_the_specs_follow_the_name_rule():
    run_wide = {
        "fedaval_setup",
        "fedaval_make_model",
        "fedaval_shared_keys",
        "fedaval_classify",
        "fedaval_round_metrics",
        "fedaval_teardown",
        "fedaval_federation_model",
        "fedaval_register_scenarios",
        "fedaval_register_datasets",
        "fedaval_register_models",
    }
    for name in SPECS:
        assert name.startswith(("fedaval_client_", "fedaval_server_")) or name in run_wide, name


@pytest.mark.parametrize("name", SPECS)
def test_every_hook_is_in_the_readme_table(name):
    table = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| ")]
    assert any(f"`{name}`" in line for line in table), f"{name} is missing from README's hook table"


@pytest.mark.parametrize("name", SPECS)
def test_every_hook_is_in_the_hook_order_test(name):
    assert f"def {name}(" in (ROOT / "tests" / "test_hook_order.py").read_text()


@pytest.mark.parametrize("name", SPECS)
def test_every_hook_has_a_test_of_its_own(name):
    """Beyond the hook-order recorder: some other test (a method's, or one
    written for the hook) uses it."""
    users = [
        path.name
        for path in (ROOT / "tests").glob("test_*.py")
        if path.name not in ("test_hook_order.py", Path(__file__).name) and re.search(rf"\b{name}\b", path.read_text())
    ]
    assert users, f"no test besides the hook-order test uses {name}"


@pytest.mark.parametrize("name", SPECS)
def test_every_hook_is_documented(name):
    from fedaval import hookspecs

    doc = getattr(hookspecs, name).__doc__ or ""
    assert len(doc.split()) >= 15, f"{name} needs a docstring saying when it runs and how results combine"


class Misspelt:
    name = "misspelt"

    @hookimpl
    def fedaval_client_los(self, run, client, batch):
        return {"x": 0}


class Unmarked:
    name = "unmarked"

    def fedaval_client_loss(self, run, client, batch):  # no @hookimpl: would never run
        return {"x": 0}


def test_a_misspelt_hook_is_refused_naming_the_closest_spec():
    with pytest.raises(
        FedavalUsageError,
        match="'misspelt' implements 'fedaval_client_los', which is no fedaval hook; did you mean 'fedaval_client_loss'",
    ):
        load_plugins(get_plugin_manager(), [], {}, extra=[Misspelt()])


def test_a_hook_method_without_hookimpl_is_refused():
    with pytest.raises(FedavalUsageError, match="'unmarked' has a method 'fedaval_client_loss' without @hookimpl"):
        load_plugins(get_plugin_manager(), [], {}, extra=[Unmarked()])


def test_a_misspelt_hook_is_a_one_line_cli_error(tmp_path, monkeypatch):
    from helpers import one_line_error

    (tmp_path / "typo.py").write_text(
        "from fedaval import hookimpl\n\n\nclass Typo:\n    name = 'typo'\n\n"
        "    @hookimpl\n    def fedaval_client_recieve(self, run, client, download):\n        pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    line = one_line_error(["train", "--plugins", "typo:Typo", "--out", str(tmp_path / "run"), "--quiet"])
    assert "fedaval_client_recieve" in line and "fedaval_client_receive" in line


def test_plugins_listing_shows_hooks_registered_under_specname():
    from fedaval.plugin_manager import hook_names
    from fedaval.plugins.fedrep import FedRep

    names = hook_names(FedRep)
    assert "fedaval_client_task_end" in names  # PersonalHead's restore_trainable_at_task_end (specname=)
    assert "restore_trainable_at_task_end" not in names

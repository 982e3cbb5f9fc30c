"""The integrations' tests under the oldest releases the README supports (transformers,
TRL, diffusers), which scripts/setup.sh installs into build/: a chosen part of each file's
parity and error tests, all in one pytest session, so that its rank pools and its imports
start once (three sessions took twice as long). A family an old release lacks is skipped
there with the reason; TRL's oldest release runs on transformers' oldest, as a user pinned
to old releases would run them."""

from __future__ import annotations

from pathlib import Path

from optional_dependency import run_under_oldest_releases

OLDEST_SUPPORTED = {"transformers": "4.56.2", "trl": "1.15.0", "diffusers": "0.35.2"}

# test file: its tests to rerun (pytest -k over the test names): each public path once, at two
# ranks (one rank pool for the whole session: a test at another world size starts another
# pool, 15-30 s under these imports); the modes themselves do not depend on the release.
SELECTIONS = {
    "test_transformers_integration.py": "one_group and 2 or cannot_be_honoured or register "
    "or family_in_one_process or every_family_matches_under_ulysses or masks_are_read or head or refuses",
    "test_transformers_trainer.py": "mixin",
    "test_transformers_vision.py": "match_one_process and 2 or trainer or cannot_be_honoured",
    "test_transformers_post_training.py": "test_dpo_matches",
    "test_diffusers_integration.py": "latte_and_wan and 2",
}


def test_the_integrations_under_their_oldest_supported_releases():
    selection = " or ".join(f"{Path(name).stem} and ({chosen})" for name, chosen in SELECTIONS.items())
    files = [str(Path(__file__).with_name(name)) for name in SELECTIONS]
    run_under_oldest_releases(OLDEST_SUPPORTED, files, selection)

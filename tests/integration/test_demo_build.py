"""`make experts`'s builder on a tiny model: it trains through `expertctl expert train`, signs with
the demo key it makes and trusts, and a second run keeps what is up to date."""

from __future__ import annotations

from libs.experts.demo.build import build, demo_key
from libs.experts.demo.catalog import Recipe
from libs.experts.demo.dates import DateNormalisation
from libs.experts.demo.tickets import TicketTriage
from libs.experts.package import read_package
from libs.experts.signing import Keyring

RECIPES = (
    Recipe(DateNormalisation(), num_train=24, epochs=1, learning_rate=1e-3, batch_size=8),
    Recipe(TicketTriage(), num_train=24, epochs=1, learning_rate=1e-2, batch_size=8),
)


def test_the_set_is_built_signed_trusted_and_then_kept(tiny_llama, tmp_path):
    key = demo_key(tmp_path / "keys", tmp_path / "trusted")
    first = build(tiny_llama, tmp_path / "experts", key, log=lambda _: None, recipes=RECIPES)
    assert [b.name for b in first] == ["date-normalize", "ticket-triage"] and all(
        b.seconds > 0 for b in first
    )
    trusted = Keyring.from_dir(tmp_path / "trusted")
    packages = [read_package(b.package, trusted) for b in first]
    assert [p.manifest.adapter_type for p in packages] == ["lora", "ia3"]
    assert all(len(p.manifest.examples) == 22 for p in packages)  # the training prompts less the 2 held out

    again = build(tiny_llama, tmp_path / "experts", key, log=lambda _: None, recipes=RECIPES)
    assert [b.seconds for b in again] == [0.0, 0.0]
    assert [b.package.read_bytes() for b in again] == [b.package.read_bytes() for b in first]

    changed = (Recipe(DateNormalisation(), num_train=24, epochs=1, learning_rate=2e-3, batch_size=8),)
    (retrained,) = build(tiny_llama, tmp_path / "experts", key, log=lambda _: None, recipes=changed)
    assert retrained.seconds > 0

"""Every shipped artifact has a card: a README.md whose YAML front matter names its library, licence and (for a CORE
artifact) the base model it compresses, as Hugging Face model cards do."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = sorted(p for p in (ROOT / "checkpoints").iterdir() if p.is_dir())


def front_matter(card: Path) -> dict:
    text = card.read_text()
    assert text.startswith("---\n"), f"{card}: no YAML front matter"
    return yaml.safe_load(text.split("---\n", 2)[1])


@pytest.mark.parametrize("folder", ARTIFACTS, ids=[p.name for p in ARTIFACTS])
def test_every_artifact_has_a_card_with_front_matter(folder):
    card = folder / "README.md"
    assert card.is_file(), f"{folder} has no card (README.md)"
    meta = front_matter(card)
    assert meta.get("license") and meta.get("library_name"), f"{card}: license and library_name are required"
    if (folder / "final" / "config.json").is_file():  # a CORE artifact: the model it was trained for
        assert meta.get("base_model"), f"{card}: a CORE artifact's card names its base_model"


def test_the_artifacts_are_the_ones_the_docs_name():
    assert {"core-proxy", "core-smollm2", "proxy-lm"} <= {p.name for p in ARTIFACTS}

"""`make conformance-diff`'s served setup: what both revisions are started with is a config this
server takes, with the keys the suite's key-needing cases use."""

from __future__ import annotations

from serve_app.access.keys import KeyRing
from serve_app.config.options import ServeConfig
from serve_app.conformance import revisions


def test_both_sides_are_served_with_keys_a_profile_and_faults_where_known(model_dirs, tmp_path):
    flags, target = revisions.served_setup(tmp_path / "new", faults=True)
    config_path = flags[flags.index("--config") + 1]
    keys_path = flags[flags.index("--api-keys") + 1]
    config = ServeConfig.from_yaml(config_path, model=str(model_dirs("llama")),
                                   api_keys_file=keys_path)  # fmt: skip
    assert config.fault_injection is True
    assert config.admin_api_key == target.admin_key
    assert [p.name for p in config.generations.profiles] == ["conformance_text"]
    assert config.generations.data_dir.startswith(str(tmp_path))
    ring = KeyRing(config.api_keys)
    model = config.model_id
    assert ring.authenticate(f"Bearer {target.api_key}").can_use_model(model)
    assert ring.authenticate(f"Bearer {target.restricted_key}").can_use_model(model) is False
    limited = ring.authenticate(f"Bearer {target.limited_key}")
    assert limited.can_use_model(model)
    # Without the setting on the old side, neither side gets it.
    flags, _ = revisions.served_setup(tmp_path / "old", faults=False)
    config = ServeConfig.from_yaml(flags[1], model=str(model_dirs("llama")))
    assert config.fault_injection is False


def test_the_fault_setting_is_found_in_a_tree(tmp_path):
    options = tmp_path / "serve_app" / "config" / "options.py"
    options.parent.mkdir(parents=True)
    options.write_text("class ServeConfig:\n    model: str\n")
    assert revisions.knows_fault_injection(tmp_path) is False
    options.write_text("class ServeConfig:\n    fault_injection: bool = False\n")
    assert revisions.knows_fault_injection(tmp_path) is True

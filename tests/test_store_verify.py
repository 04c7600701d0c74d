"""`hpcrl traj verify`/`ls` judge a writer's lease by the run's own `store.lease_s`."""

from __future__ import annotations

from hpcrl.core.config import StoreConfig, load_config, write_resolved
from hpcrl.rl.store.verify import store_lease_s, verify_store


def test_the_lease_is_the_runs_store_lease_else_the_default(tmp_path):
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    write_resolved(load_config(None, ["store.lease_s=7.5"]), run)
    assert store_lease_s(run / "trajectories") == 7.5
    bare = tmp_path / "bare"
    bare.mkdir()
    assert store_lease_s(bare) == StoreConfig().lease_s
    (tmp_path / "broken" / "trajectories").mkdir(parents=True)
    (tmp_path / "broken" / "config.resolved.yaml").write_text("store: {lease_s: -1}\n")
    assert store_lease_s(tmp_path / "broken" / "trajectories") == StoreConfig().lease_s


def test_an_empty_store_verifies_to_no_shards(tmp_path):
    assert verify_store(tmp_path, lease_s=30.0) == []

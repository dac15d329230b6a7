"""attnkit/run/shards.py and the Ray driver's shard settings: shard files written by earlier versions stay valid,
so the settings fingerprint of a shard must stay the same bytes for the same settings (and change when the same
settings no longer give the same numbers, as when the plan began cutting units by tokens)."""
import pytest

from attnkit.engine import ExtractSettings
from attnkit.engine.ray.driver import ShardedRun
from attnkit.errors import AttnkitError
from attnkit.run.shards import ShardStore, shard_dir

RUN_SETTINGS = {"corpus": "c", "max_length": 40}
# computed when the plan began cutting units by tokens (attnkit/engine/plan.py; the engine settings gained "plan")
FEATURES_FINGERPRINT = "55b9d3187acd7095d23507962907d60270e7e6917e512a3429a6a8f3997711e1"
DISTANCES_FINGERPRINT = "6f2bcce9498bf75dea8292a66f0d42a02541e84bf1820dba5dd684254eb45c1c"
# those of the same settings before it (attnkit 0.1.0 to the character plan): such shard files hold the sums of
# other forwards, so a resume must refuse them
CHARACTER_PLAN_FINGERPRINTS = ("fdda823dcc1ea6f07dc7fbf49c213d3cd9493ca295afcff53325c265a306345c",
                               "8883d2da3da2b5cc0930d0083ff660cd9d845ff75029cc7c948c84a6b4d13d4a")


def _store(kind, tmp_path, **extra):
    run = ShardedRun(kind, [], ExtractSettings(max_length=40, batch_size=8, window=50), run_dir=tmp_path,
                     run_settings=RUN_SETTINGS, model_path=None, dtype="float32", address=None, num_actors=None,
                     cpus_per_actor=1, progress=False, shards_per_group=None, **extra)
    store, finished = run.store(8)
    return store, finished


def test_shard_fingerprints_are_those_of_earlier_versions(tmp_path):
    store, finished = _store("features", tmp_path)
    assert store.fingerprint == FEATURES_FINGERPRINT and finished == set()
    store, _ = _store("distances", tmp_path, rows_per_sample=3, seed=7)
    assert store.fingerprint == DISTANCES_FINGERPRINT
    assert not {FEATURES_FINGERPRINT, DISTANCES_FINGERPRINT} & set(CHARACTER_PLAN_FINGERPRINTS)


def test_a_corrupt_shard_file_is_refused_by_name(tmp_path):
    d = shard_dir(tmp_path)
    d.mkdir()
    (d / "shard-000003.npz").write_bytes(b"not an npz file")
    with pytest.raises(AttnkitError, match=r"shard file .*shard-000003\.npz is unreadable or corrupt") as e:
        ShardStore(d, RUN_SETTINGS, "features").finished()
    assert "\n" not in str(e.value)

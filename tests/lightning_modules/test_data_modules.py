"""Data modules: per-epoch order and augmentation from (seed, epoch), cached lookups, atomic reports."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch

import lightning_modules.callbacks.report_writer as report_writer
import lightning_modules.data.ct_cache_datamodule as ct_cache_datamodule
from lightning_modules import BagArrayDataModule, CTCacheDataModule, ReportWriter
from lightning_modules.data.sampler import EpochSampler
from lightning_modules.input_error import InputError
from lm_helpers import feature_bags
from milgp.ct.augment import BagAugment
from milgp.data.bags import BagBatch
from milgp.ct.cache import CTCache


def test_epoch_sampler_order_depends_on_seed_and_epoch_only(tiny_cache: str) -> None:
    """The shuffled order must be reproducible from (seed, epoch), change with the epoch, leave the global RNG
    alone, shard into disjoint rank slices of one shared order (a DistributedSampler, which Lightning does not
    replace under DDP), and set_epoch must reach the dataset (the augmentation draw)."""
    dm = CTCacheDataModule(tiny_cache, augment=BagAugment(), seed=5)
    ds = dm.dataset("all", train=True)
    sampler = EpochSampler(ds, shuffle=True, seed=5)
    rng_before = torch.get_rng_state()
    sampler.set_epoch(2)
    order = list(sampler)
    assert torch.equal(torch.get_rng_state(), rng_before) and ds.epoch == 2
    assert sorted(order) == list(range(len(ds))) and order != sorted(order)
    again = EpochSampler(ds, shuffle=True, seed=5)
    again.set_epoch(2)
    assert list(again) == order
    sampler.set_epoch(3)
    assert list(sampler) != order
    shards = [EpochSampler(ds, shuffle=True, seed=5, num_replicas=2, rank=r) for r in (0, 1)]
    for s in shards:
        s.set_epoch(2)
    assert isinstance(shards[0], torch.utils.data.DistributedSampler)
    assert list(shards[0]) == order[0::2] and list(shards[1]) == order[1::2]
    assert list(EpochSampler(ds)) == list(range(len(ds)))


class _Recorder(pl.LightningModule):
    """Records every training batch's slices per (epoch, bag id)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[tuple[int, str], torch.Tensor] = {}

    def training_step(self, batch: BagBatch, batch_idx: int) -> torch.Tensor:
        for b, bag_id in enumerate(batch.bag_ids):
            self.seen[(self.current_epoch, bag_id)] = batch.x[batch.bag_index == b].clone()
        return self.w * batch.x.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_augmentation_changes_every_epoch_without_reloading(tiny_cache: str) -> None:
    """With the default trainer (dataloaders built once) every training bag must get epoch e's augmentation
    draw in epoch e: different between epochs and equal to the dataset's item at set_epoch(e). If the epoch
    only reached the dataset when a dataloader was built, every epoch would train on the same augmented bags."""
    dm = CTCacheDataModule(tiny_cache, augment=BagAugment(), seed=1, batch_size=2)
    model = _Recorder()
    pl.Trainer(accelerator="cpu", max_epochs=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(model, dm)
    reference = dm.dataset(dm.train_split, train=True)
    assert len(model.seen) == 2 * len(reference)
    for epoch in (0, 1):
        reference.set_epoch(epoch)
        for i, bag_id in enumerate(reference.bag_ids):
            torch.testing.assert_close(model.seen[(epoch, bag_id)], reference[i][0], rtol=0, atol=0)
    assert all(not torch.equal(model.seen[(0, b)], model.seen[(1, b)]) for b in reference.bag_ids)


def test_the_ct_cache_loader_pins_memory_only_where_a_gpu_can_use_it(tiny_cache: str) -> None:
    """``pin_memory=None`` pins batches when a CUDA device is present (their copy to it then
    overlaps the computation) and not on a CPU-only machine, where pinning has nothing to gain;
    an explicit value is what the loader gets."""
    dm = CTCacheDataModule(tiny_cache, batch_size=2)
    dm.setup("fit")
    assert dm.pin_memory == torch.cuda.is_available() and dm.train_dataloader().pin_memory == dm.pin_memory
    off = CTCacheDataModule(tiny_cache, batch_size=2, pin_memory=False)
    off.setup("fit")
    assert off.train_dataloader().pin_memory is False


def test_split_and_patient_lookups_read_the_cache_once(tiny_cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """split_of/patient_of (called per bag by FeatureWriter) must be dict lookups over maps built once, with
    the right answers; re-reading the manifest per call made feature extraction quadratic in the bags."""
    opened: list[str] = []
    monkeypatch.setattr(ct_cache_datamodule, "CTCache", lambda d: opened.append(d) or CTCache(d))
    dm = CTCacheDataModule(tiny_cache)
    ids = dm.splits["all"]
    patients = [dm.patient_of(b) for b in ids * 3]
    splits = [dm.split_of(b) for b in ids * 3]
    assert len(opened) <= 2
    truth = CTCache(tiny_cache)
    assert patients == [truth.entry(b).patient_id for b in ids * 3]
    assert splits == [next(name for name in ("train", "val", "test") if b in dm.splits[name]) for b in ids] * 3
    assert dm.split_of("nope") == ""
    with pytest.raises(KeyError, match="'nope' is not in the cache"):
        dm.patient_of("nope")
    data = feature_bags(num_bags=6)
    arrays = BagArrayDataModule(**data, bag_ids=list("abcdef"), patient_ids=list("ppqqrs"), splits=["train"] * 4 + ["test"] * 2)
    assert [arrays.split_of(b) for b in "abcdef"] == ["train"] * 4 + ["test"] * 2 and arrays.split_of("z") == ""
    assert [arrays.patient_of(b) for b in "abcdef"] == list("ppqqrs")


def _trainer(folder: Path) -> SimpleNamespace:
    """What ReportWriter reads of a trainer: the version folder, the run folder, data and checkpoint."""
    return SimpleNamespace(loggers=[], default_root_dir=str(folder), datamodule=None, ckpt_path=None, state=SimpleNamespace(fn="test"))


def test_report_writer_never_leaves_a_truncated_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash while writing the test report must leave the previous metrics file intact and no temporary file;
    a plain open(..., "w") would have truncated it to a partial JSON."""
    writer = ReportWriter(name="m")
    previous = {"model": "m", "metrics": {"bag_auc": 0.9}, "num_bags": 3}
    (tmp_path / "metrics.json").write_text(json.dumps(previous))

    class Module:
        test_records: list = []
        test_metrics = {"bag_auc": 0.8, "broken": object()}

    monkeypatch.setattr(report_writer, "json_safe", lambda obj: obj)  # let the unserialisable value through
    with pytest.raises(TypeError):
        writer.on_test_end(_trainer(tmp_path), Module())
    assert json.loads((tmp_path / "metrics.json").read_text()) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_report_writer_handles_aggregate_targets(tmp_path: Path) -> None:
    """With an aggregate-output likelihood the records hold counts (bag_label 7.0) and rates: the
    report must still write metrics and predictions, and must not draw probability plots (the
    calibration plot would reject labels outside {0, 1})."""
    writer = ReportWriter(name="agg")

    class Module:
        is_aggregate = True
        test_metrics = {"bag_mse": 1.5, "bag_nll": 2.0}
        test_records = [
            {"bag_id": "a", "bag_label": 7.0, "bag_prob": 6.2, "bag_std": 1.1, "slice_probs": [1.0, 2.5], "slice_stds": [0.2, 0.3]},
            {"bag_id": "b", "bag_label": 3.0, "bag_prob": 3.4, "bag_std": 0.9, "slice_probs": [3.4], "slice_stds": [0.4]},
        ]

    writer.on_test_end(_trainer(tmp_path), Module())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "predictions.json"]
    assert json.loads((tmp_path / "metrics.json").read_text())["metrics"]["bag_mse"] == 1.5
    assert [r["bag_label"] for r in json.loads((tmp_path / "predictions.json").read_text())] == [7.0, 3.0]


def test_truncated_splits_file_is_a_one_line_error_naming_it(tiny_cache: str, tmp_path: Path) -> None:
    """A truncated splits file must stop the data module with one line naming the file (not a bare
    JSONDecodeError from deep inside setup)."""
    bad = tmp_path / "splits.json"
    bad.write_text(Path(tiny_cache, "splits.json").read_text()[:25])
    dm = CTCacheDataModule(tiny_cache, splits_file=str(bad))
    with pytest.raises(ValueError, match=r"splits\.json is not a splits file .*rerun milgp-cache with --splits"):
        dm.splits


def test_all_serves_every_cached_bag_and_a_splits_file_is_checked(tiny_cache: str, tmp_path: Path) -> None:
    """``"all"`` was the union of train, val and test: a cache grown after ``--splits`` (or a bag in
    an ``external`` split) was left out of ``predict_split: all`` without a word, and a bag listed in
    train and test was trained and tested on (and served twice by ``all``)."""
    splits = json.loads(Path(tiny_cache, "splits.json").read_text())
    cached = sorted(CTCache(tiny_cache).bag_ids)

    def module(edit) -> CTCacheDataModule:
        changed = {k: list(v) for k, v in splits.items()}
        edit(changed)
        path = tmp_path / f"splits_{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(changed))
        return CTCacheDataModule(tiny_cache, splits_file=str(path))

    dropped = module(lambda s: s["train"].pop())
    with pytest.warns(UserWarning, match="1 bags have no split while the others do"):
        assert sorted(dropped.splits["all"]) == cached
    external = module(lambda s: s.update(external=[s["test"].pop()]))
    assert sorted(external.splits["all"]) == cached and len(external.splits["external"]) == 1
    leak = module(lambda s: s["test"].append(s["train"][0]))
    with pytest.raises(InputError, match=r"bag '.*' is listed in split 'train' and again in 'test'; each bag belongs to one split"):
        leak.splits
    misspelt = module(lambda s: s.update(validation=s.pop("val")))
    with pytest.raises(InputError, match=r"has split 'validation'.*did you mean 'val'"):
        misspelt.splits


def test_each_stage_checks_the_labels_it_needs_after_an_earlier_stage() -> None:
    """``trainer.test`` after ``trainer.fit`` on the same data module must still refuse an
    unlabelled test bag (the check ran once per data module, so the test split went unchecked
    after fit), while an unlabelled bag outside the stage's splits stays allowed."""
    from lightning_modules import InputError

    data = feature_bags(num_bags=10)
    data["bag_labels"] = [float("nan") if i == 9 else y for i, y in enumerate(data["bag_labels"])]
    dm = BagArrayDataModule(**data, splits=["train"] * 6 + ["val"] * 2 + ["test"] * 2)
    dm.setup("fit")
    dm.setup("predict")
    with pytest.raises(InputError, match="'bag_9' has no usable label"):
        dm.setup("test")

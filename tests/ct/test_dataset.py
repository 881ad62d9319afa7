"""milgp.ct.dataset and milgp.ct.augment: the end-to-end round trip and bag-consistent augmentation."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from milgp.ct.augment import AugmentParams, BagAugment
from milgp.data.bags import collate_bags
from milgp.ct.dataset import CTBagDataset, uniform_subsample
from milgp.ct.hounsfield import read_hu
from milgp.ct.windows import ct_channels
from milgp.ct.synthetic import SyntheticDataset


def test_round_trip_synthetic_to_dataset(rsna_synth: SyntheticDataset, rsna_cache: str) -> None:
    """Synthetic DICOM -> RSNA index -> cache -> dataset must give, for every bag, the written bag label, the
    lesion slices labelled positive, and slices in the anatomical order that was written (each served slice
    equals the windowed truth slice at the same position). Failing breaks training labels or slice order."""
    ds = CTBagDataset(rsna_cache)
    assert len(ds) == len(rsna_synth.scans)
    for i in range(len(ds)):
        x, labels, bag_label, bag_id = ds[i]
        truth = rsna_synth.scan(bag_id)
        assert x.dtype == torch.float32 and x.shape == (len(truth.paths), 3, 24, 24)
        assert bag_label == truth.bag_label
        assert labels is not None and labels.tolist() == list(truth.slice_labels)
        expected = torch.from_numpy(np.stack([ct_channels(read_hu(p), size=24) for p in truth.paths]))
        torch.testing.assert_close(x, expected, atol=0.5 / 255 + 1e-6, rtol=0)


def test_collate_into_a_bag_batch(rsna_cache: str) -> None:
    """Dataset items must collate with milgp.data.bags.collate_bags into the flat representation (flat instances plus a bag index)."""
    ds = CTBagDataset(rsna_cache)
    batch = collate_bags([ds[0], ds[1], ds[2]])
    sizes = [ds[i][0].shape[0] for i in range(3)]
    assert batch.x.shape == (sum(sizes), 3, 24, 24) and batch.num_bags == 3
    assert torch.equal(torch.bincount(batch.bag_index), torch.tensor(sizes))
    assert batch.instance_labels is not None and batch.instance_labels.shape == (sum(sizes),)
    assert batch.bag_ids == ds.bag_ids[:3]


def test_uniform_subsample_keeps_order_and_ends() -> None:
    """Subsampling must return distinct increasing indices including the first and last slice, for every
    (num_slices, max_slices) pair -- duplicates or reordering would corrupt the bag."""
    for n in range(1, 60):
        for m in range(1, n + 3):
            idx = uniform_subsample(n, m)
            assert len(idx) == min(n, m) and np.all(np.diff(idx) > 0) and idx[-1] < n
            if 2 <= m < n:
                assert idx[0] == 0 and idx[-1] == n - 1
    assert uniform_subsample(10, None).tolist() == list(range(10))
    with pytest.raises(ValueError):
        uniform_subsample(10, 0)


def test_max_slices_subsamples_slices_and_labels_together(rsna_cache: str) -> None:
    """With max_slices the served slices and their labels must be the same subset of the full bag."""
    full, sub = CTBagDataset(rsna_cache), CTBagDataset(rsna_cache, max_slices=4)
    for i in range(len(full)):
        x_full, lab_full, _, _ = full[i]
        x_sub, lab_sub, _, _ = sub[i]
        idx = torch.from_numpy(sub.slice_indices(i))
        assert x_sub.shape[0] == min(4, x_full.shape[0])
        torch.testing.assert_close(x_sub, x_full[idx])
        assert torch.equal(lab_sub, lab_full[idx])
        assert sub.slice_labels(i).tolist() == lab_sub.long().tolist()


def test_instance_label_accessor(rsna_synth: SyntheticDataset, rsna_cache: str) -> None:
    """instance_labels() must concatenate served slice labels in dataset order with a matching bag index."""
    ds = CTBagDataset(rsna_cache)
    out = ds.instance_labels()
    assert out is not None
    labels, bag_index = out
    expected = np.concatenate([rsna_synth.scan(b).slice_labels for b in ds.bag_ids])
    np.testing.assert_array_equal(labels, expected)
    np.testing.assert_array_equal(np.bincount(bag_index), [len(rsna_synth.scan(b).paths) for b in ds.bag_ids])
    np.testing.assert_array_equal(ds.bag_labels, [rsna_synth.scan(b).bag_label for b in ds.bag_ids])


def test_bag_subsets_and_splits(rsna_cache: str, tmp_path: Path) -> None:
    """bag_ids must select and order bags; unknown ids must raise naming the bag; from_split reads splits.json."""
    ids = CTBagDataset(rsna_cache).bag_ids
    sub = CTBagDataset(rsna_cache, bag_ids=[ids[2], ids[0]])
    assert [sub[0][3], sub[1][3]] == [ids[2], ids[0]]
    with pytest.raises(KeyError, match="'nope' is not in the cache"):
        CTBagDataset(rsna_cache, bag_ids=["nope"])
    splits_path = Path(rsna_cache) / "splits.json"
    splits_path.write_text(json.dumps({"train": ids[:3], "val": ids[3:]}))
    try:
        assert CTBagDataset.from_split(rsna_cache, "val").bag_ids == ids[3:]
        with pytest.raises(KeyError, match="no split 'test'"):
            CTBagDataset.from_split(rsna_cache, "test")
    finally:
        splits_path.unlink()


def test_augmentation_is_off_by_default_and_deterministic(rsna_cache: str) -> None:
    """Without augment the cache is served as stored; with it, the same (seed, epoch, bag) gives the same
    tensor, another epoch a different one, and values stay in [0, 1]."""
    plain = CTBagDataset(rsna_cache)
    a = CTBagDataset(rsna_cache, augment=BagAugment(), seed=7)
    b = CTBagDataset(rsna_cache, augment=BagAugment(), seed=7)
    x_plain = plain[0][0]
    assert torch.equal(plain[0][0], x_plain)
    x_a = a[0][0]
    assert torch.equal(x_a, b[0][0]) and not torch.equal(x_a, x_plain)
    assert x_a.min() >= 0 and x_a.max() <= 1
    a.set_epoch(1)
    assert not torch.equal(a[0][0], x_a)
    assert torch.equal(a[0][1], plain[0][1])


def test_a_seed_that_cannot_seed_the_draws_is_refused_when_the_dataset_is_made(rsna_cache: str) -> None:
    """seed=-1 was accepted and failed at the first augmented item, inside a worker, with numpy's
    bare "expected non-negative integer"."""
    for seed in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"seed must be an integer >= 0, got"):
            CTBagDataset(rsna_cache, augment=BagAugment(), seed=seed)
    assert CTBagDataset(rsna_cache, seed=np.int64(3)).seed == 3


def test_augmentation_is_the_same_for_every_slice_of_a_bag() -> None:
    """A bag of identical slices must stay a bag of identical slices: one flip/affine/intensity draw per bag."""
    base = torch.rand(1, 3, 20, 20)
    bag = base.expand(6, 3, 20, 20).clone()
    out = BagAugment(flip_p=0.5, max_rotation_deg=15, max_translate=0.1)(bag, torch.Generator().manual_seed(3))
    assert not torch.equal(out[0], base[0])
    for k in range(1, 6):
        torch.testing.assert_close(out[k], out[0])


def test_augmentation_components() -> None:
    """The identity transform must return the input; a pure flip must equal torch.flip along width; a shift of
    a quarter image must move content a quarter image right; intensity jitter must be affine then clipped."""
    x = torch.rand(2, 3, 16, 16)
    ident = AugmentParams(False, 0.0, (0.0, 0.0), 1.0, 1.0, 0.0)
    torch.testing.assert_close(BagAugment.apply(x, ident), x)
    flip = AugmentParams(True, 0.0, (0.0, 0.0), 1.0, 1.0, 0.0)
    torch.testing.assert_close(BagAugment.apply(x, flip), x.flip(-1))
    shift = AugmentParams(False, 0.0, (0.25, 0.0), 1.0, 1.0, 0.0)
    torch.testing.assert_close(BagAugment.apply(x, shift)[..., 4:], x[..., :12])
    bright = AugmentParams(False, 0.0, (0.0, 0.0), 1.0, 2.0, 0.1)
    torch.testing.assert_close(BagAugment.apply(x, bright), (2 * x + 0.1).clamp(0, 1))


def test_set_epoch_reaches_persistent_dataloader_workers(rsna_cache: str) -> None:
    """With persistent DataLoader workers, set_epoch in the main process must still change the augmentation;
    otherwise every epoch would train on the same augmented bags."""
    ds = CTBagDataset(rsna_cache, bag_ids=CTBagDataset(rsna_cache).bag_ids[:1], augment=BagAugment(), seed=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=1, collate_fn=collate_bags, num_workers=1, persistent_workers=True)
    first = next(iter(loader)).x
    ds.set_epoch(1)
    second = next(iter(loader)).x
    assert not torch.equal(first, second)
    torch.testing.assert_close(second, ds[0][0])


def test_split_with_bags_the_manifest_lacks_is_one_line(rsna_synth, tmp_path: Path) -> None:
    """After an interrupted rerun cut the manifest, from_split must say in one line which split lists
    bags the manifest lacks, how many, one of them, and how to repair (a ValueError, and still a
    KeyError). Before, it was a bare KeyError from the first missing bag, quoted, naming no split."""
    import shutil

    from milgp.ct.cache import CacheCorruptError
    from milgp.ct.dataset import SplitNotCachedError

    cache = tmp_path / "cache"
    shutil.copytree(_rsna_cache_dir(rsna_synth, tmp_path), cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    ids = [b["bag_id"] for b in manifest["bags"]]
    (cache / "splits.json").write_text(json.dumps({"train": ids[:4], "val": ids[4:6], "test": ids[6:]}))
    manifest["bags"] = manifest["bags"][:5]  # the rerun was interrupted before it listed the others
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert CTBagDataset.from_split(cache, "train").bag_ids == ids[:4]
    with pytest.raises(SplitNotCachedError) as exc:
        CTBagDataset.from_split(cache, "val")
    assert isinstance(exc.value, CacheCorruptError) and isinstance(exc.value, KeyError)
    text = str(exc.value)
    assert "\n" not in text and not text.startswith(("'", '"'))
    assert "split 'val' lists 1 of its 2 bags" in text and repr(ids[5]) in text and "verify" in text


def _rsna_cache_dir(rsna_synth, tmp_path: Path) -> Path:
    from milgp.ct.cache import CacheParams, build_cache
    from milgp.ct.rsna import index_rsna

    out = tmp_path / "built"
    build_cache(index_rsna(rsna_synth.image_dir, rsna_synth.labels_csv), out, CacheParams(size=8), progress=False)
    return out

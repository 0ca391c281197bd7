"""imagefolder:, csv: and parquet: datasets (and npz class counts) on files the tests write:
what loads, what each mistake says, and 2-round jobs on an image folder and a CSV file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fedcore.data import DatasetError, clear_cache, load_dataset
from proto.job import DataSpec, JobSpec, TrainingSpec


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    clear_cache()


def write_images(root: Path, per_class: int = 6, classes: tuple[str, ...] = ("cat", "dog", "owl"),
                 size: tuple[int, int] = (8, 6), mode: str = "L") -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for k, cls in enumerate(classes):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            # each class has its own brightness, so a model can learn it
            base = 40 + 80 * k
            shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
            pixels = np.clip(base + rng.integers(-20, 20, shape), 0, 255).astype(np.uint8)
            Image.fromarray(pixels, mode=mode).save(root / cls / f"{i:03d}.png")
    return root


def write_table(path: Path, n: int = 40, label: str = "label", classes: int = 3,
                labels: np.ndarray | None = None) -> Path:
    rng = np.random.default_rng(1)
    y = np.arange(n) % classes if labels is None else labels
    lines = [f"f1,f2,f3,{label}"]
    for i in range(n):
        f = rng.normal(y[i], 0.3, 3)
        lines.append(f"{f[0]:.4f},{f[1]:.4f},{f[2]:.4f},{int(y[i])}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_imagefolder_flat_tree_is_split_and_labelled_by_folder(tmp_path: Path) -> None:
    root = write_images(tmp_path / "imgs")
    d = load_dataset(f"imagefolder:{root}")
    assert d.num_classes == 3 and d.input_shape == (1, 6, 8)
    assert len(d.y_train) + len(d.y_test) == 18 and len(d.y_test) == 3  # 20% of each class
    assert sorted(set(d.y_test.tolist())) == [0, 1, 2]
    assert d.x_train.dtype == np.float32 and 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0
    # folder "cat" (label 0) is darker than "owl" (label 2)
    assert d.x_train[d.y_train == 0].mean() < d.x_train[d.y_train == 2].mean()
    assert load_dataset(f"imagefolder:{root}") is d


def test_imagefolder_train_test_tree_rgb(tmp_path: Path) -> None:
    write_images(tmp_path / "t" / "train", per_class=4, mode="RGB")
    write_images(tmp_path / "t" / "test", per_class=2, classes=("cat", "owl"), mode="RGB")
    d = load_dataset(f"imagefolder:{tmp_path / 't'}")
    assert d.input_shape == (3, 6, 8) and d.num_classes == 3
    assert len(d.y_train) == 12 and d.y_test.tolist() == [0, 0, 2, 2]


def test_imagefolder_mistakes_name_the_file(tmp_path: Path) -> None:
    root = write_images(tmp_path / "imgs", per_class=3)
    write_images(tmp_path / "imgs", per_class=1, classes=("dog",), size=(5, 5))  # overwrites 000.png
    with pytest.raises(DatasetError, match=r"dog/000\.png: size 5x5 differs from .*cat/000\.png \(8x6\).*#size=WxH"):
        load_dataset(f"imagefolder:{root}")
    assert load_dataset(f"imagefolder:{root}#size=4x4").input_shape == (1, 4, 4)
    (root / "owl" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(DatasetError, match=r"owl/broken\.png: cannot decode it"):
        load_dataset(f"imagefolder:{root}#size=4x4")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: no class subfolders"):
        load_dataset(f"imagefolder:{tmp_path / 'empty'}")
    with pytest.raises(DatasetError, match=r"cannot read folder .*nowhere"):
        load_dataset(f"imagefolder:{tmp_path / 'nowhere'}")
    with pytest.raises(DatasetError, match=r"#size=4 must be WIDTHxHEIGHT"):
        load_dataset(f"imagefolder:{root}#size=4")


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_tables_load_with_default_and_named_label_column(tmp_path: Path, kind: str) -> None:
    csv = write_table(tmp_path / "t.csv", label="target")
    path = csv
    if kind == "parquet":
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        path = tmp_path / "t.parquet"
        pq.write_table(pacsv.read_csv(csv), path)
    with pytest.raises(DatasetError, match=rf"t\.{kind}: no label column 'label'; columns are 'f1', 'f2', 'f3', 'target'; name it with {kind}:PATH#label=COLUMN"):
        load_dataset(f"{kind}:{path}")
    d = load_dataset(f"{kind}:{path}#label=target")
    assert d.num_classes == 3 and d.input_shape == (3,)
    assert len(d.y_train) == 31 and len(d.y_test) == 9  # 20% of 14, 13, 13 rounded
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64


def test_table_mistakes_are_one_line_naming_file_and_column(tmp_path: Path) -> None:
    cases = {
        "strings.csv": ("f1,colour,label\n1,red,0\n2,blue,1\n", r"feature column 'colour' has type string"),
        "floatlab.csv": ("f1,label\n1,0.5\n2,1.5\n", r"label column 'label' has type double"),
        "holes.csv": ("f1,label\n1,0\n,1\n", r"column 'f1' has 1 missing value"),
        "onlylabel.csv": ("label\n0\n1\n", r"only the label column"),
        "neg.csv": ("f1,label\n1,-1\n2,0\n", r"negative label -1"),
    }
    for file, (text, message) in cases.items():
        (tmp_path / file).write_text(text)
        with pytest.raises(DatasetError, match=message) as info:
            load_dataset(f"csv:{tmp_path / file}")
        assert file in str(info.value) and "\n" not in str(info.value)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nonsense")
    with pytest.raises(DatasetError, match=r"bad\.parquet: not a readable parquet file"):
        load_dataset(f"parquet:{tmp_path / 'bad.parquet'}")
    with pytest.raises(DatasetError, match=r"option 'lable=y' is not understood; csv: datasets take #label=..., #classes=..."):
        load_dataset(f"csv:{tmp_path / 'neg.csv'}#lable=y")


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_label_column_of_names_takes_the_class_list_from_the_name(tmp_path: Path,
                                                                    kind: str) -> None:
    """Species, diagnosis, cultivar: names are ids by their place in #classes=NAME,...; the
    list is asked for, not guessed (a site whose file lacks a class would number the others
    differently), and the error offers the names it found."""
    rng = np.random.default_rng(0)
    names = np.array(["setosa", "virginica", "versicolor"])[np.arange(30) % 3]
    x = rng.normal(size=(30, 2)) + (np.arange(30) % 3)[:, None]
    path = tmp_path / f"iris.{kind}"
    import pyarrow as pa
    table = pa.table({"f1": x[:, 0], "f2": x[:, 1], "species": names})
    if kind == "csv":
        import pyarrow.csv as pacsv
        pacsv.write_csv(table, path)
    else:
        import pyarrow.parquet as pq
        pq.write_table(table, path)
    with pytest.raises(DatasetError, match=rf"iris\.{kind}: label column 'species' holds names "
                       r"\('setosa', 'versicolor', 'virginica'\); list the classes .*"
                       rf"{kind}:PATH#label=species&classes=setosa,versicolor,virginica$"):
        load_dataset(f"{kind}:{path}#label=species")
    order = ["virginica", "setosa", "versicolor", "unseen"]
    d = load_dataset(f"{kind}:{path}#label=species&classes={','.join(order)}")
    assert d.num_classes == 4  # a listed class no row has is a class still
    train_names = [order[k] for k in d.y_train]
    # every row keeps its own name: the ids follow the list, not the file's order
    ids = {n: i for i, n in enumerate(order)}
    assert sorted(train_names + [order[k] for k in d.y_test]) == sorted(names.tolist())
    assert all(ids[n] == k for n, k in zip(train_names, d.y_train, strict=True))
    with pytest.raises(DatasetError, match=r"name\(s\) 'versicolor' \(10 sample\(s\)\) not in "
                       r"#classes=setosa,virginica"):
        load_dataset(f"{kind}:{path}#label=species&classes=setosa,virginica")
    with pytest.raises(DatasetError, match=r"'setosa' twice"):
        load_dataset(f"{kind}:{path}#label=species&classes=setosa,setosa,virginica")
    if kind == "parquet":  # a pandas category column: a dictionary of names
        pq.write_table(table.set_column(2, "species", table.column("species").dictionary_encode()),
                       path)
        clear_cache()
        again = load_dataset(f"{kind}:{path}#label=species&classes={','.join(order)}")
        np.testing.assert_array_equal(again.y_train, d.y_train)
    with pytest.raises(DatasetError, match=r"holds double values, not names"):
        load_dataset(f"{kind}:{path}#label=f1&classes=a,b")
    np.savez(tmp_path / "d.npz", x_train=x, y_train=np.arange(30) % 3, x_test=x[:3],
             y_test=np.arange(3))
    with pytest.raises(DatasetError, match=r"only a csv: or parquet: label column of names"):
        load_dataset(f"npz:{tmp_path / 'd.npz'}#classes=a,b,c")


def test_stray_labels_are_caught_with_or_without_a_declared_class_count(tmp_path: Path) -> None:
    labels = np.arange(40) % 3
    labels[7] = 255
    path = write_table(tmp_path / "stray.csv", labels=labels)
    with pytest.raises(DatasetError, match=r"stray\.csv: column 'label' has label 255 \(1 sample\(s\)\), which makes 256 classes, but 252 of them never occur \(3, 4, 5, 6, 7 \.\.\.\)"):
        load_dataset(f"csv:{path}")
    with pytest.raises(DatasetError, match=r"stray\.csv: column 'label' has label 255 \(in y_\w+\) outside 0\.\.2 for 3 classes"):
        load_dataset(f"csv:{path}#classes=3")
    ok = write_table(tmp_path / "ok.csv")
    assert load_dataset(f"csv:{ok}#classes=5").num_classes == 5  # classes may be absent if declared

    x = np.zeros((10, 2), np.float32)
    y = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 10])
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:3], y_test=y[:3])
    with pytest.raises(DatasetError, match=r"d\.npz: y_train/y_test has label 10 .* makes 11 classes"):
        load_dataset(f"npz:{tmp_path / 'd.npz'}")
    np.savez(tmp_path / "e.npz", x_train=x, y_train=y, x_test=x[:3], y_test=y[:3], num_classes=np.int64(3))
    with pytest.raises(DatasetError, match=r"e\.npz: .*label 10 \(in y_train\) outside 0\.\.2 for 3 classes"):
        load_dataset(f"npz:{tmp_path / 'e.npz'}")
    np.savez(tmp_path / "f.npz", x_train=x, y_train=y, x_test=x[:3], y_test=y[:3], num_classes=np.int64(12))
    assert load_dataset(f"npz:{tmp_path / 'f.npz'}").num_classes == 12


def two_round_job(dataset: str, model: str = "mlp") -> JobSpec:
    spec = JobSpec(job_id="files", seed=2, data=DataSpec(dataset=dataset, number_of_clients=3,
                                                         data_distribution_kind="iid"),
                   training=TrainingSpec(federated_learning_rounds=2, number_of_epochs=2))
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, name=model))


@pytest.mark.parametrize("kind", ["imagefolder", "csv"])
def test_two_round_job_on_an_image_folder_and_a_csv_file(tmp_path: Path, kind: str) -> None:
    from tests.e2e.test_one_engine import run

    if kind == "imagefolder":
        name = f"imagefolder:{write_images(tmp_path / 'imgs', per_class=10)}"
        model = "cnn"
    else:
        name = f"csv:{write_table(tmp_path / 't.csv', n=60)}"
        model = "mlp"
    result, _ = run(two_round_job(name, model), ("solo",))
    metrics = result.summary.rounds
    assert [m.round for m in metrics] == [1, 2]
    assert all(m.participants == 3 for m in metrics)
    assert 0.0 <= metrics[-1].accuracy <= 1.0 and np.isfinite(metrics[-1].loss)


def test_job_file_resolves_and_checks_file_datasets(tmp_path: Path) -> None:
    from proto.job import JobSpecError
    from scheduler.jobfile import load_job

    write_table(tmp_path / "t.csv", label="y")
    job = tmp_path / "job.toml"
    job.write_text('[data]\ndataset = "csv:t.csv#label=y"\n')
    spec = load_job(job)
    assert spec.data.dataset == f"csv:{tmp_path / 't.csv'}#label=y"
    assert load_dataset(spec.data.dataset).num_classes == 3
    job.write_text('[data]\ndataset = "imagefolder:no-such-dir"\n')
    with pytest.raises(JobSpecError, match=r"data.dataset: folder .*no-such-dir does not exist"):
        load_job(job)
    job.write_text('[data]\ndataset = "parquet:missing.parquet"\n')
    with pytest.raises(JobSpecError, match=r"data.dataset: file .*missing\.parquet does not exist"):
        load_job(job)


def write_raw_wine(path: Path) -> Path:
    """sklearn's wine table as it ships: 13 features on their own scales (proline up to
    1,680, hue around 1)."""
    from sklearn.datasets import load_wine

    x, y = load_wine(return_X_y=True)
    header = ",".join([f"f{i}" for i in range(x.shape[1])] + ["label"])
    np.savetxt(path, np.column_stack([x, y]), delimiter=",", header=header, comments="",
               fmt=["%.4f"] * x.shape[1] + ["%d"])
    return path


def test_a_table_off_a_unit_scale_is_standardized_with_its_training_rows(
        tmp_path: Path) -> None:
    """data.standardize: "auto" standardizes a simulated job's table whose features lie off
    a unit scale, train and test rows by the training rows' mean and sd, and leaves one
    already scaled as it is; "features" always, "none" never; a pinned job's site keeps
    its rows until the plan brings the statistics every site shares."""
    from fedcore.data import prepare

    raw = load_dataset(f"csv:{write_raw_wine(tmp_path / 'wine.csv')}")
    assert raw.x_train.max() > 1000
    done = prepare(raw, DataSpec())
    mean, sd = raw.x_train.mean(axis=0), raw.x_train.std(axis=0)
    np.testing.assert_allclose(done.x_train.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(done.x_train.std(axis=0), 1.0, atol=1e-3)
    np.testing.assert_allclose(done.x_test, (raw.x_test - mean) / sd, rtol=1e-4, atol=1e-4)
    assert done.x_train.dtype == np.float32 and np.array_equal(done.y_train, raw.y_train)
    assert prepare(raw, DataSpec(standardize="none")) is raw
    # a pinned site's samples wait for the statistics every site shares (job.plan)
    assert prepare(raw, DataSpec(placement="pinned")) is raw
    assert prepare(raw, DataSpec(placement="pinned", standardize="features")) is raw

    scaled = load_dataset(f"csv:{write_table(tmp_path / 't.csv', n=60)}")
    assert prepare(scaled, DataSpec()) is scaled
    forced = prepare(scaled, DataSpec(standardize="features"))
    np.testing.assert_allclose(forced.x_train.std(axis=0), 1.0, atol=1e-3)
    images = load_dataset("digits")  # (1, 8, 8) in [0, 1]
    assert prepare(images, DataSpec()) is images
    shifted = prepare(images, DataSpec(standardize="features"))
    np.testing.assert_allclose(shifted.x_train.std(), 1.0, atol=1e-3)
    constant = dataclasses.replace(raw, x_train=raw.x_train.copy())
    constant.x_train[:, 0] = 7.0
    assert np.isfinite(prepare(constant, DataSpec()).x_train).all()


def test_bytes_images_are_standardized_per_channel(tmp_path: Path) -> None:
    """Images saved as bytes (0-255; two channels on their own scales here) are
    standardized per channel by the training images' mean and sd under "auto"."""
    from fedcore.data import prepare

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 2, 4, 4)).astype(np.uint8)
    x[:, 1] //= 4
    y = np.arange(40) % 2
    np.savez(tmp_path / "b.npz", x_train=x[:30], y_train=y[:30], x_test=x[30:], y_test=y[30:])
    raw = load_dataset(f"npz:{tmp_path / 'b.npz'}")
    done = prepare(raw, DataSpec())
    assert done.x_train.shape == raw.x_train.shape == (30, 2, 4, 4)
    for c in (0, 1):
        channel = raw.x_train[:, c].astype(np.float64)
        np.testing.assert_allclose(done.x_train[:, c].mean(), 0.0, atol=1e-4)
        np.testing.assert_allclose(done.x_train[:, c].std(), 1.0, atol=1e-3)
        np.testing.assert_allclose(done.x_test[:, c],
                                   (raw.x_test[:, c] - channel.mean()) / channel.std(),
                                   rtol=1e-4, atol=1e-4)


def test_a_raw_table_learns_through_the_engine(tmp_path: Path) -> None:
    """The wine table as it ships, 9 clients, 3 rounds of star FedAvg at the defaults:
    standardized ("auto") it learns; as it is ("none") the model stays at the largest
    class, as centralized training does on it."""
    from tests.e2e.test_one_engine import run

    name = f"csv:{write_raw_wine(tmp_path / 'wine.csv')}"
    base = JobSpec(data=DataSpec(dataset=name, number_of_clients=9, dirichlet_beta=0.5),
                   training=TrainingSpec(federated_learning_rounds=3, number_of_epochs=2))
    learned, _ = run(base)
    raw, _ = run(dataclasses.replace(base, data=dataclasses.replace(base.data,
                                                                     standardize="none")))
    largest = np.bincount(load_dataset(name).y_test).max() / len(load_dataset(name).y_test)
    assert learned.summary.rounds[-1].accuracy > 0.85
    assert raw.summary.rounds[-1].accuracy < largest + 0.1


def test_shared_scaling_is_the_sites_median_and_a_liar_moves_it_little() -> None:
    """fedcore.data.shared_scaling: per feature the median of the sites' means, and the
    root of the median of their second moments about it (the spread between sites
    counts); a fourth site claiming a mean of 1e9 leaves both within the honest sites'
    own; "auto" on a unit scale and "none": no scaling; malformed moments: named."""
    from fedcore.data import shared_scaling

    honest = {"a": {"count": 50, "mean": [100.0, 0.1], "var": [25.0, 0.04]},
              "b": {"count": 70, "mean": [110.0, 0.2], "var": [36.0, 0.04]},
              "c": {"count": 60, "mean": [130.0, 0.3], "var": [49.0, 0.04]}}
    found = shared_scaling(honest, "auto")
    assert found is not None
    mean, sd = found
    assert mean == [110.0, 0.2]
    assert sd[0] == pytest.approx(np.sqrt(np.median([25 + 100, 36 + 0, 49 + 400])))
    liar = shared_scaling({**honest, "z": {"count": 10**9, "mean": [1e9, 1e9],
                                           "var": [1e18, 1e18]}}, "auto")
    assert liar is not None
    assert 110.0 <= liar[0][0] <= 130.0 and liar[1][0] < 25.0
    small = {k: {**v, "mean": [m / 1000 for m in v["mean"]], "var": [0.01, 0.01]}
             for k, v in honest.items()}
    assert shared_scaling(small, "auto") is None and shared_scaling(small, "features")
    assert shared_scaling(honest, "none") is None
    for bad in ({"count": 5, "mean": [1.0], "var": [1.0, 2.0]},
                {"count": 5, "mean": [float("nan"), 1.0], "var": [1.0, 1.0]},
                {"count": -1, "mean": [1.0, 1.0], "var": [1.0, 1.0]},
                {"count": 5, "mean": [1.0, 1.0], "var": [-1.0, 1.0]},
                {"count": 5, "mean": "x", "var": [1.0, 1.0]}, None):
        with pytest.raises(ValueError, match="site z: data moments"):
            shared_scaling({**honest, "z": bad}, "auto")

"""TableConfig / ModelSpec: construction-time validation, layout, data types, JSON form."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from infer.config import MAX_ROWS, DataType, ModelSpec, PoolingType, TableConfig
from infer.errors import ConfigError, EmbserveError


def table(name: str = "t0", rows: int = 100, dim: int = 8, features: tuple[str, ...] = ("f0",), **kw) -> TableConfig:
    return TableConfig(name, rows, dim, features, **kw)


def shared_spec() -> ModelSpec:
    return ModelSpec(
        (
            TableConfig("a", 100, 8, ("a1", "a2")),
            TableConfig("b", 50, 4, ("b1",)),
            TableConfig("c", 1000, 12, ("c1", "c2", "c3")),
        )
    )


# --------------------------------------------------------------------------- TableConfig validation


@pytest.mark.parametrize("rows", [0, -1, -1000, 10.0, "10", None, True, MAX_ROWS + 1])
def test_bad_num_embeddings_names_table(rows):
    with pytest.raises(ConfigError, match="my_table") as info:
        TableConfig("my_table", rows, 8, ("f",))
    assert "num_embeddings" in str(info.value)


@pytest.mark.parametrize("dim", [0, -4, 8.0, "8", None, False, 4096])
def test_bad_embedding_dim_names_table(dim):
    with pytest.raises(ConfigError, match="my_table") as info:
        TableConfig("my_table", 10, dim, ("f",))
    assert "embedding_dim" in str(info.value)


@pytest.mark.parametrize("dim", [4, 12, 20])
def test_int2_needs_a_dim_of_eight(dim):
    """fbgemm's quantizer refuses INT2 rows of an odd number of bytes ("ncols needs to be multiple of 2 Bytes", which
    named no table): refused here naming the table, as a whole-table type and as a block's."""
    with pytest.raises(ConfigError, match="'my_table'.*int2.*multiple of 8"):
        TableConfig("my_table", 10, dim, ("f",), data_type="int2")
    with pytest.raises(ConfigError, match="'my_table'.*int2.*multiple of 8"):
        TableConfig("my_table", 10, dim, ("f",), blocks=((2, "int8"), (8, "int2")))
    assert TableConfig("my_table", 10, dim, ("f",), data_type="int4").embedding_dim == dim


def test_an_int2_table_of_dim_eight_quantizes():
    from infer.quant.quantize import quantize
    from infer.weights import random_weights

    spec = ModelSpec((TableConfig("t", 10, 8, ("f",), data_type="int2"),))
    assert quantize(spec, random_weights(spec)).embeddings is not None


@pytest.mark.parametrize("dim", [1, 2, 3, 5, 6, 10, 126])
def test_dim_not_multiple_of_four(dim):
    with pytest.raises(ConfigError, match="my_table") as info:
        TableConfig("my_table", 10, dim, ("f",))
    assert "multiple of 4" in str(info.value)
    assert str(dim) in str(info.value)


@pytest.mark.parametrize("dim", [4, 8, 12, 128, 2048])
def test_good_dims_accepted(dim):
    assert TableConfig("t", 10, dim, ("f",)).embedding_dim == dim


def test_max_rows_accepted():
    assert TableConfig("t", MAX_ROWS, 4, ("f",)).num_embeddings == MAX_ROWS


@pytest.mark.parametrize("features", [(), []])
def test_empty_feature_list(features):
    with pytest.raises(ConfigError, match="my_table") as info:
        TableConfig("my_table", 10, 8, features)
    assert "empty" in str(info.value)


def test_duplicate_features_name_table_and_feature():
    with pytest.raises(ConfigError, match="my_table") as info:
        TableConfig("my_table", 10, 8, ("f1", "f2", "f1"))
    assert "f1" in str(info.value)
    assert "duplicate" in str(info.value)


@pytest.mark.parametrize("feature", ["", "1abc", "has space", 3, None])
def test_invalid_feature_name(feature):
    with pytest.raises(ConfigError, match="my_table"):
        TableConfig("my_table", 10, 8, ("ok", feature))


@pytest.mark.parametrize("name", ["", "9t", "a b", "t/x", 5, None])
def test_invalid_table_name(name):
    with pytest.raises(ConfigError):
        TableConfig(name, 10, 8, ("f",))


@pytest.mark.parametrize("name", ["t", "_t", "T_1", "user.id", "item-x"])
def test_valid_table_names(name):
    assert TableConfig(name, 10, 8, ("f",)).name == name


def test_single_string_feature_becomes_tuple():
    t = TableConfig("t", 10, 8, "only")
    assert t.feature_names == ("only",)


def test_feature_list_becomes_tuple():
    t = TableConfig("t", 10, 8, ["x", "y"])
    assert t.feature_names == ("x", "y")
    assert isinstance(t.feature_names, tuple)


@pytest.mark.parametrize("dtype", ["fp8", "float32", "int3", "", "bf16"])
def test_unknown_dtype_names_table(dtype):
    with pytest.raises(ConfigError, match="my_table") as info:
        TableConfig("my_table", 10, 8, ("f",), data_type=dtype)
    assert repr(dtype) in str(info.value)


@pytest.mark.parametrize("pooling", ["max", "avg", "", "summ"])
def test_unknown_pooling_names_table(pooling):
    with pytest.raises(ConfigError, match="my_table") as info:
        TableConfig("my_table", 10, 8, ("f",), pooling=pooling)
    assert repr(pooling) in str(info.value)


def test_config_error_is_embserve_and_value_error():
    with pytest.raises(EmbserveError):
        TableConfig("t", 0, 8, ("f",))
    with pytest.raises(ValueError):
        TableConfig("t", 0, 8, ("f",))


# --------------------------------------------------------------------------- string parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fp32", DataType.FP32),
        ("FP16", DataType.FP16),
        ("int8", DataType.INT8),
        ("Int4", DataType.INT4),
        ("INT2", DataType.INT2),
        (DataType.FP16, DataType.FP16),
    ],
)
def test_dtype_parsing(text, expected):
    assert DataType.parse(text) is expected
    assert table(data_type=text).data_type is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sum", PoolingType.SUM),
        ("SUM", PoolingType.SUM),
        ("Mean", PoolingType.MEAN),
        (PoolingType.MEAN, PoolingType.MEAN),
    ],
)
def test_pooling_parsing(text, expected):
    assert table(pooling=text).pooling is expected


def test_defaults():
    t = table()
    assert t.pooling is PoolingType.SUM
    assert t.data_type is DataType.INT8


@pytest.mark.parametrize(("dtype", "bits"), [("fp32", 32), ("fp16", 16), ("int8", 8), ("int4", 4), ("int2", 2)])
def test_dtype_bits(dtype, bits):
    assert DataType.parse(dtype).bits == bits


def test_dtype_is_integer():
    assert {d for d in DataType if d.is_integer} == {DataType.INT8, DataType.INT4, DataType.INT2}


def test_dtype_parse_unknown():
    with pytest.raises(ConfigError, match="fp8"):
        DataType.parse("fp8")


# --------------------------------------------------------------------------- ModelSpec validation


def test_spec_without_tables():
    with pytest.raises(ConfigError):
        ModelSpec(())


def test_spec_tables_must_be_table_configs():
    with pytest.raises(ConfigError):
        ModelSpec(({"name": "t"},))


def test_duplicate_table_names():
    with pytest.raises(ConfigError, match="twice") as info:
        ModelSpec((table("dup", features=("f1",)), table("other", features=("f2",)), table("dup", features=("f3",))))
    assert "'dup'" in str(info.value)


def test_feature_on_two_tables_names_feature_and_tables():
    with pytest.raises(ConfigError) as info:
        ModelSpec((table("ta", features=("x", "shared")), table("tb", features=("shared",))))
    msg = str(info.value)
    assert "'shared'" in msg
    assert "'ta'" in msg
    assert "'tb'" in msg


def test_dense_arch_without_num_dense_features():
    with pytest.raises(ConfigError, match="num_dense_features"):
        ModelSpec((table(),), dense_arch=torch.nn.Identity())
    with pytest.raises(ConfigError, match="num_dense_features"):
        ModelSpec((table(),), 0, torch.nn.Identity())


def test_dense_arch_with_num_dense_features():
    arch = torch.nn.Identity()
    spec = ModelSpec((table(),), 3, arch)
    assert spec.dense_arch is arch
    assert spec.num_dense_features == 3


@pytest.mark.parametrize("n", [-1, 1.0, "2", True, None])
def test_bad_num_dense_features(n):
    with pytest.raises(ConfigError, match="num_dense_features"):
        ModelSpec((table(),), n)


def test_tables_list_becomes_tuple():
    spec = ModelSpec([table()])
    assert isinstance(spec.tables, tuple)


# --------------------------------------------------------------------------- layout


def test_shared_tables_feature_order_and_columns():
    spec = shared_spec()
    assert spec.feature_names == ("a1", "a2", "b1", "c1", "c2", "c3")
    layout = [(f.name, f.table, f.num_embeddings, f.embedding_dim, f.column_start, f.column_end) for f in spec.features]
    assert layout == [
        ("a1", "a", 100, 8, 0, 8),
        ("a2", "a", 100, 8, 8, 16),
        ("b1", "b", 50, 4, 16, 20),
        ("c1", "c", 1000, 12, 20, 32),
        ("c2", "c", 1000, 12, 32, 44),
        ("c3", "c", 1000, 12, 44, 56),
    ]
    assert spec.output_dim == 56


def test_feature_order_follows_table_then_feature_order_not_alphabetical():
    spec = ModelSpec((TableConfig("z", 10, 4, ("zz", "aa")), TableConfig("a", 10, 8, ("mm",))))
    assert spec.feature_names == ("zz", "aa", "mm")
    assert [f.column_start for f in spec.features] == [0, 4, 8]
    assert spec.output_dim == 16


def test_features_carry_pooling():
    spec = ModelSpec(
        (TableConfig("s", 10, 4, ("s1", "s2"), pooling="sum"), TableConfig("m", 10, 4, ("m1",), pooling="mean"))
    )
    assert [f.pooling for f in spec.features] == [PoolingType.SUM, PoolingType.SUM, PoolingType.MEAN]


def test_table_lookup():
    spec = shared_spec()
    assert spec.table("b").embedding_dim == 4
    with pytest.raises(ConfigError, match="nope"):
        spec.table("nope")


# --------------------------------------------------------------------------- data types


def test_with_data_types_default_and_overrides():
    spec = ModelSpec(
        (
            table("a", features=("fa",), data_type="int8"),
            table("b", features=("fb",), data_type="fp32"),
            table("c", features=("fc",), data_type="int2"),
        )
    )
    out = spec.with_data_types("int4", {"b": "fp16", "c": DataType.FP32})
    assert [t.data_type for t in out.tables] == [DataType.INT4, DataType.FP16, DataType.FP32]
    # the original is unchanged
    assert [t.data_type for t in spec.tables] == [DataType.INT8, DataType.FP32, DataType.INT2]
    # everything but the data type is kept
    for old, new in zip(spec.tables, out.tables, strict=True):
        assert (old.name, old.num_embeddings, old.embedding_dim, old.feature_names, old.pooling) == (
            new.name,
            new.num_embeddings,
            new.embedding_dim,
            new.feature_names,
            new.pooling,
        )


def test_with_data_types_default_only():
    spec = ModelSpec((table("a", features=("fa",)), table("b", features=("fb",), data_type="fp32")))
    out = spec.with_data_types(DataType.FP16)
    assert [t.data_type for t in out.tables] == [DataType.FP16, DataType.FP16]


def test_with_data_types_overrides_only_keep_others():
    spec = ModelSpec((table("a", features=("fa",), data_type="int4"), table("b", features=("fb",), data_type="fp32")))
    out = spec.with_data_types(overrides={"b": "int8"})
    assert [t.data_type for t in out.tables] == [DataType.INT4, DataType.INT8]


def test_with_data_types_no_args_is_identity():
    spec = shared_spec()
    assert spec.with_data_types() == spec


def test_with_data_types_keeps_dense_part():
    arch = torch.nn.Identity()
    spec = ModelSpec((table(),), 5, arch)
    out = spec.with_data_types("fp16")
    assert out.num_dense_features == 5
    assert out.dense_arch is arch


def test_with_data_types_unknown_table_override():
    spec = shared_spec()
    with pytest.raises(ConfigError, match="ghost"):
        spec.with_data_types("int8", {"a": "fp16", "ghost": "fp32"})


def test_with_data_types_unknown_dtype():
    with pytest.raises(ConfigError, match="fp7"):
        shared_spec().with_data_types(overrides={"a": "fp7"})


def test_table_with_data_type():
    t = table(data_type="int8")
    assert t.with_data_type("fp16").data_type is DataType.FP16
    assert t.data_type is DataType.INT8


# --------------------------------------------------------------------------- JSON form


def test_json_round_trip():
    spec = ModelSpec(
        (
            TableConfig("a", 100, 8, ("a1", "a2"), pooling="mean", data_type="fp16"),
            TableConfig("b.x", 7, 8, ("b1",), data_type="int2"),
        ),
        num_dense_features=13,
    )
    text = spec.to_json()
    back = ModelSpec.from_json(text)
    assert back == spec
    assert back.tables[0].pooling is PoolingType.MEAN
    assert back.tables[0].data_type is DataType.FP16
    assert back.num_dense_features == 13
    assert back.to_json() == text


def test_json_form_is_plain():
    spec = ModelSpec((TableConfig("a", 100, 8, ("a1", "a2"), pooling="mean", data_type="fp16"),), 2)
    assert json.loads(spec.to_json()) == {
        "tables": [
            {
                "name": "a",
                "num_embeddings": 100,
                "embedding_dim": 8,
                "feature_names": ["a1", "a2"],
                "pooling": "mean",
                "data_type": "fp16",
            }
        ],
        "num_dense_features": 2,
    }


def test_json_drops_dense_arch():
    spec = ModelSpec((table(),), 4, torch.nn.Identity())
    back = ModelSpec.from_json(spec.to_json())
    assert back.dense_arch is None
    assert back == spec  # dense_arch is not compared


def test_table_from_dict_defaults():
    t = TableConfig.from_dict({"name": "t", "num_embeddings": 10, "embedding_dim": 4, "feature_names": ["f"]})
    assert t == TableConfig("t", 10, 4, ("f",), PoolingType.SUM, DataType.INT8)


def test_table_from_dict_unknown_keys():
    data = {**table("my_table").to_dict(), "dims": 8}
    with pytest.raises(ConfigError, match="my_table") as info:
        TableConfig.from_dict(data)
    assert "dims" in str(info.value)


@pytest.mark.parametrize("key", ["num_embeddings", "embedding_dim", "feature_names"])
def test_table_from_dict_missing_keys(key):
    data = table("my_table").to_dict()
    del data[key]
    with pytest.raises(ConfigError, match="my_table") as info:
        TableConfig.from_dict(data)
    assert key in str(info.value)


def test_table_from_dict_missing_name():
    data = table().to_dict()
    del data["name"]
    with pytest.raises(ConfigError, match="name"):
        TableConfig.from_dict(data)


def test_spec_from_dict_validates_tables():
    data = shared_spec().to_dict()
    data["tables"][1]["embedding_dim"] = 6
    with pytest.raises(ConfigError, match="'b'"):
        ModelSpec.from_dict(data)


def test_spec_from_dict_unknown_table_key():
    data = shared_spec().to_dict()
    data["tables"][2]["rows"] = 3
    with pytest.raises(ConfigError, match="rows"):
        ModelSpec.from_dict(data)


@pytest.mark.parametrize("data", [{}, {"num_dense_features": 1}, [], "tables", {"tables": "abc"}, {"tables": 3}])
def test_spec_from_dict_without_tables(data):
    with pytest.raises(ConfigError):
        ModelSpec.from_dict(data)


def test_spec_from_dict_unknown_top_level_key():
    data = {**shared_spec().to_dict(), "num_dense_feature": 3}
    with pytest.raises(ConfigError, match="num_dense_feature"):
        ModelSpec.from_dict(data)


def test_spec_from_dict_bad_num_dense_features():
    data = {**shared_spec().to_dict(), "num_dense_features": "abc"}
    with pytest.raises(ConfigError):
        ModelSpec.from_dict(data)


def test_from_json_invalid_json():
    with pytest.raises(ConfigError, match="JSON"):
        ModelSpec.from_json("{not json")


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope" / "spec.json"
    with pytest.raises(ConfigError, match="spec.json"):
        ModelSpec.load(path)


def test_load_round_trip(tmp_path):
    spec = shared_spec()
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    assert ModelSpec.load(path) == spec
    assert ModelSpec.load(str(path)) == spec


# --------------------------------------------------------------------------- frozen


def test_table_is_frozen():
    t = table()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.num_embeddings = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.data_type = DataType.FP32
    assert t.num_embeddings == 100


def test_spec_is_frozen():
    spec = shared_spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tables = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_dense_features = 3


def test_feature_info_is_frozen():
    info = shared_spec().features[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.column_start = 4


def test_configs_are_hashable_and_equal_by_value():
    assert table() == table()
    assert hash(table()) == hash(table())
    assert shared_spec() == shared_spec()
    assert table(rows=100) != table(rows=101)


# --- issue 39 item 1: a pooling nobody stated -----------------------------------------------------------------


def test_null_pooling_round_trips_and_is_refused_until_stated():
    import infer
    from infer.weights import random_weights

    text = json.dumps(
        {
            "tables": [
                {"name": "a", "num_embeddings": 10, "embedding_dim": 4, "feature_names": ["fa"], "pooling": None},
                {"name": "b", "num_embeddings": 10, "embedding_dim": 4, "feature_names": ["fb"], "pooling": "mean"},
                {"name": "c", "num_embeddings": 10, "embedding_dim": 4, "feature_names": ["fc"]},  # documented: sum
            ]
        }
    )
    spec = ModelSpec.from_json(text)
    assert spec.unstated_pooling == ("a",)
    assert ModelSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json())["tables"][0]["pooling"] is None
    assert spec.with_data_types("fp16").unstated_pooling == ("a",)  # copies keep it unstated
    with pytest.raises(ConfigError) as info:
        infer.quantize(spec, random_weights(spec))
    assert "table(s) ['a'] is not stated" in str(info.value) and "with_pooling" in str(info.value)
    stated = spec.with_pooling({"a": "mean"})
    assert stated.unstated_pooling == () and stated.table("a").pooling == PoolingType.MEAN
    assert json.loads(stated.to_json())["tables"][0]["pooling"] == "mean"
    infer.quantize(stated, random_weights(stated))
    with pytest.raises(ConfigError, match="unknown table"):
        spec.with_pooling({"z": "sum"})
    with pytest.raises(ConfigError, match="unknown pooling 'max'"):
        spec.with_pooling({"a": "max"})

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IdType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ID_TYPE_INT64: _ClassVar[IdType]
    ID_TYPE_INT32: _ClassVar[IdType]

class OutputType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_TYPE_FP32: _ClassVar[OutputType]
    OUTPUT_TYPE_FP16: _ClassVar[OutputType]
ID_TYPE_INT64: IdType
ID_TYPE_INT32: IdType
OUTPUT_TYPE_FP32: OutputType
OUTPUT_TYPE_FP16: OutputType

class FeatureBags(_message.Message):
    __slots__ = ("lengths", "ids", "weights")
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, lengths: _Optional[_Iterable[int]] = ..., ids: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class TypedFeatures(_message.Message):
    __slots__ = ("features",)
    class FeaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: FeatureBags
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[FeatureBags, _Mapping]] = ...) -> None: ...
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    features: _containers.MessageMap[str, FeatureBags]
    def __init__(self, features: _Optional[_Mapping[str, FeatureBags]] = ...) -> None: ...

class PackedFeatures(_message.Message):
    __slots__ = ("feature_order", "lengths", "ids", "id_type", "weights")
    FEATURE_ORDER_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ID_TYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    feature_order: _containers.RepeatedScalarFieldContainer[str]
    lengths: bytes
    ids: bytes
    id_type: IdType
    weights: bytes
    def __init__(self, feature_order: _Optional[_Iterable[str]] = ..., lengths: _Optional[bytes] = ..., ids: _Optional[bytes] = ..., id_type: _Optional[_Union[IdType, str]] = ..., weights: _Optional[bytes] = ...) -> None: ...

class SparseFeatures(_message.Message):
    __slots__ = ("typed", "packed")
    TYPED_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    typed: TypedFeatures
    packed: PackedFeatures
    def __init__(self, typed: _Optional[_Union[TypedFeatures, _Mapping]] = ..., packed: _Optional[_Union[PackedFeatures, _Mapping]] = ...) -> None: ...

class ColumnRange(_message.Message):
    __slots__ = ("feature", "start", "end")
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    feature: str
    start: int
    end: int
    def __init__(self, feature: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("sparse", "output_type", "model_name", "model_version")
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    sparse: SparseFeatures
    output_type: OutputType
    model_name: str
    model_version: str
    def __init__(self, sparse: _Optional[_Union[SparseFeatures, _Mapping]] = ..., output_type: _Optional[_Union[OutputType, str]] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("batch_size", "dim", "output_type", "embeddings", "columns", "model_version")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    dim: int
    output_type: OutputType
    embeddings: bytes
    columns: _containers.RepeatedCompositeFieldContainer[ColumnRange]
    model_version: str
    def __init__(self, batch_size: _Optional[int] = ..., dim: _Optional[int] = ..., output_type: _Optional[_Union[OutputType, str]] = ..., embeddings: _Optional[bytes] = ..., columns: _Optional[_Iterable[_Union[ColumnRange, _Mapping]]] = ..., model_version: _Optional[str] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("sparse", "dense_features", "model_name", "model_version")
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FEATURES_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    sparse: SparseFeatures
    dense_features: bytes
    model_name: str
    model_version: str
    def __init__(self, sparse: _Optional[_Union[SparseFeatures, _Mapping]] = ..., dense_features: _Optional[bytes] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("batch_size", "scores", "model_version")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    scores: bytes
    model_version: str
    def __init__(self, batch_size: _Optional[int] = ..., scores: _Optional[bytes] = ..., model_version: _Optional[str] = ...) -> None: ...

class GetModelMetadataRequest(_message.Message):
    __slots__ = ("model_name", "model_version")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class TableMetadata(_message.Message):
    __slots__ = ("name", "num_embeddings", "embedding_dim", "data_type", "pooling", "feature_names")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    FEATURE_NAMES_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_embeddings: int
    embedding_dim: int
    data_type: str
    pooling: str
    feature_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., num_embeddings: _Optional[int] = ..., embedding_dim: _Optional[int] = ..., data_type: _Optional[str] = ..., pooling: _Optional[str] = ..., feature_names: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelMetadata(_message.Message):
    __slots__ = ("model_version", "format_version", "tables", "feature_order", "columns", "output_dim", "has_dense", "num_dense_features", "devices", "world_size", "embserve_version", "max_batch_size")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ORDER_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIM_FIELD_NUMBER: _ClassVar[int]
    HAS_DENSE_FIELD_NUMBER: _ClassVar[int]
    NUM_DENSE_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EMBSERVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    format_version: int
    tables: _containers.RepeatedCompositeFieldContainer[TableMetadata]
    feature_order: _containers.RepeatedScalarFieldContainer[str]
    columns: _containers.RepeatedCompositeFieldContainer[ColumnRange]
    output_dim: int
    has_dense: bool
    num_dense_features: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    world_size: int
    embserve_version: str
    max_batch_size: int
    def __init__(self, model_version: _Optional[str] = ..., format_version: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableMetadata, _Mapping]]] = ..., feature_order: _Optional[_Iterable[str]] = ..., columns: _Optional[_Iterable[_Union[ColumnRange, _Mapping]]] = ..., output_dim: _Optional[int] = ..., has_dense: _Optional[bool] = ..., num_dense_features: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., world_size: _Optional[int] = ..., embserve_version: _Optional[str] = ..., max_batch_size: _Optional[int] = ...) -> None: ...

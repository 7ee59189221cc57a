"""Keras' and TensorFlow's arguments, as a ported program passes them: taken with Keras'
meaning, or a three-part error naming what spmd does instead, before any step."""

import numpy as np
import optax
import pytest
import tensorflow as tf
from flax import nnx
from models import MLP, labelled

import spmd

X, Y = labelled(40)


def _trainer():
    return spmd.Trainer(
        MLP(nnx.Rngs(0)), optax.sgd(0.1), "sparse_categorical_crossentropy", metrics=("accuracy",)
    )


def _teaches(error, *words):
    text = str(error.value)
    assert "Received:" in text and "To fix:" in text, text
    for word in words:
        assert word in text, text


def _ds(*parts):
    return tf.data.Dataset.from_tensor_slices(parts or (X, Y))


@pytest.mark.parametrize(
    "data",
    [_ds().batch(16), [(X[:16], Y[:16])]],
    ids=["tf_data", "list_of_batches"],
)
def test_batch_size_beside_batched_data_is_an_error_naming_both(data):
    with pytest.raises(spmd.ConfigurationError) as error:
        _trainer().fit(data, batch_size=16, verbose=0)
    _teaches(error, "batch_size=16", "data=", "drop batch_size=")


def test_validation_batch_size_beside_a_validation_dataset_is_an_error_naming_it():
    with pytest.raises(spmd.ConfigurationError) as error:
        _trainer().fit(
            (X, Y), batch_size=16, validation_data=_ds().batch(16), validation_batch_size=8
        )
    _teaches(error, "validation_batch_size=8", "validation_data='_BatchDataset'")


def test_keras_fit_x_y_positional_is_an_error_saying_to_pass_one_tuple():
    with pytest.raises(spmd.ConfigurationError) as error:
        _trainer().fit(X, Y)
    _teaches(error, "batch_size=", "fit((x, y)")


@pytest.mark.parametrize("call", ["fit", "evaluate"])
def test_keras_x_and_y_keywords_are_an_error_saying_to_pass_one_tuple(call):
    with pytest.raises(spmd.ArgumentTypeError) as error:
        getattr(_trainer(), call)(x=X, y=Y, batch_size=16)
    _teaches(error, "x='an array of shape (40, 6)'", f"trainer.{call}((x, y), batch_size=64)")


def test_a_four_tuple_of_arrays_is_an_error_in_keras_terms():
    w = np.ones(40, np.float32)
    with pytest.raises(spmd.ConfigurationError) as error:
        _trainer().fit((X, Y, w, w), batch_size=16, verbose=0)
    _teaches(error, "(x, y, sample_weight)", "tuple_elements=4")


def test_an_unbatched_tf_data_dataset_is_named_as_such():
    with pytest.raises(spmd.BatchError) as error:
        _trainer().fit(_ds(), verbose=0)
    _teaches(error, "unbatched", "element_shapes=[[6], []]", ".batch(")


def test_a_ragged_tf_data_dataset_is_named_as_such():
    ragged = tf.ragged.constant([[1.0, 2.0], [3.0]])
    with pytest.raises(spmd.BatchError) as error:
        _trainer().fit(_ds(ragged, np.array([0, 1])).batch(2), verbose=0)
    _teaches(error, "RaggedTensorSpec", "padded_batch")


def test_an_unbatched_list_of_examples_is_named_as_such():
    with pytest.raises(spmd.BatchError) as error:
        _trainer().fit([(X[0], Y[0]), (X[1], Y[1])], verbose=0)
    _teaches(error, "unbatched")


@pytest.mark.parametrize("shape", [(20, 2), (10,)])
def test_sample_weights_not_one_per_example_are_an_error_naming_their_shape(shape):
    with pytest.raises(spmd.BatchError) as error:
        _trainer().fit([(X[:20], Y[:20], np.ones(shape, np.float32))], verbose=0)
    _teaches(error, f"sample_weight_shape={shape}", "labels_shape=(20,)")


@pytest.mark.parametrize(
    "call, name, words",
    [
        ("fit", "validation_split", ["validation_data=(x[n:], y[n:])"]),
        ("fit", "sample_weight", ["(x, y, sample_weight)"]),
        ("fit", "workers", ["prefetch"]),
        ("fit", "validation_freq", ["on_epoch_end"]),
        ("evaluate", "steps", ["take(n)"]),
        ("predict", "use_multiprocessing", ["prefetch"]),
        ("fit", "epoch", ["the arguments data, batch_size, epochs"]),
    ],
)
def test_a_keras_argument_spmd_does_not_take_is_named_with_what_to_do(call, name, words):
    data = X if call == "predict" else (X, Y)
    with pytest.raises(spmd.ArgumentTypeError) as error:
        getattr(_trainer(), call)(data, batch_size=16, **{name: 1})
    assert isinstance(error.value, TypeError)  # TF's own type, and spmd's ConfigurationError
    _teaches(error, f"{name}=1", *words)


def test_evaluate_return_dict_false_is_an_error_true_is_taken():
    with pytest.raises(spmd.ArgumentTypeError) as error:
        _trainer().evaluate((X, Y), batch_size=16, return_dict=False)
    _teaches(error, "return_dict=False", 'logs["loss"]')


@pytest.mark.parametrize(
    "make, name",
    [
        (
            lambda: spmd.callbacks.ModelCheckpoint("ckpt", save_weights_only=True),
            "save_weights_only",
        ),
        (lambda: spmd.callbacks.EarlyStopping(restore_best=True), "restore_best"),
        (lambda: spmd.callbacks.BackupAndRestore("b", double_checkpoint=True), "double_checkpoint"),
    ],
)
def test_a_callback_argument_spmd_does_not_take_is_an_error_naming_it(make, name):
    with pytest.raises(spmd.ArgumentTypeError) as error:
        make()
    _teaches(error, f"{name}=True")


def test_model_checkpoint_takes_keras_filepath_and_refuses_a_keras_file_name(tmp_path):
    callback = spmd.callbacks.ModelCheckpoint(filepath=str(tmp_path), verbose=1)
    assert callback.filepath == str(tmp_path)
    with pytest.raises(spmd.ConfigurationError) as error:
        spmd.callbacks.ModelCheckpoint(filepath="ckpt/weights.{epoch:02d}.weights.h5")
    _teaches(error, "directory", "CheckpointManager(filepath)")


@pytest.mark.parametrize(
    "class_weight", [{0: 1.0, 1: float("nan")}, {-1: 1.0}, [1.0, 2.0], {"a": 1.0}, {}]
)
def test_class_weight_not_a_dict_of_class_ids_to_finite_weights_is_an_error(class_weight):
    with pytest.raises(spmd.ConfigurationError) as error:
        _trainer().fit((X, Y), batch_size=16, class_weight=class_weight, verbose=0)
    _teaches(error, "class_weight=")


def test_a_label_above_every_class_weight_id_is_an_error():
    with pytest.raises(spmd.BatchError) as error:
        _trainer().fit([(X[:16], Y[:16])], class_weight={0: 1.0, 1: 2.0}, verbose=0)
    _teaches(error, "labels_max=2", "ids 0..1")


def _resolver(cluster, task_type="worker", task_id=0):
    spec = tf.train.ClusterSpec(cluster)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type=task_type, task_id=task_id
    )


def test_parameter_server_strategy_takes_tf_positional_cluster_resolver():
    strategy = spmd.ParameterServerStrategy(
        _resolver({"worker": ["localhost:2222"]}),
        variable_partitioner=spmd.partitioners.FixedShardsPartitioner(2),
    )
    assert strategy.num_replicas_in_sync == 8
    assert spmd.ParameterServerStrategy(None).num_replicas_in_sync == 8


def test_parameter_server_strategy_refuses_a_resolver_of_another_cluster():
    with pytest.raises(spmd.ConfigurationError) as error:
        spmd.ParameterServerStrategy(_resolver({"worker": ["h0:1", "h1:1"]}))
    _teaches(error, "resolver_processes=2", "joined_processes=1", "spmd.initialize()")


def test_parameter_server_strategy_refuses_a_resolver_with_ps_tasks():
    cluster = {"worker": ["h0:1"], "ps": ["h1:1"]}
    with pytest.raises(spmd.ClusterError) as error:
        spmd.ParameterServerStrategy(_resolver(cluster))
    assert "spmd runs no parameter server" in str(error.value)

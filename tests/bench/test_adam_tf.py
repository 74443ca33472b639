"""The Keras side of rows naming an optimizer (issue 25): the TF digits worker's
``build_optimizer`` maps PyTorch-style options to Keras' and fails clearly on a missing class."""
import pytest

tf = pytest.importorskip("tensorflow")
digits_tf = pytest.importorskip("hvd_gradcomp.bench.workers.digits_tf")


def test_keras_optimizers_from_row_text():
    sgd = digits_tf.build_optimizer("", 0.05)  # the workload's own: SGD, momentum 0.9
    assert isinstance(sgd, tf.keras.optimizers.legacy.SGD)
    assert sgd.get_config()["momentum"] == pytest.approx(0.9) and sgd.get_config()["learning_rate"] == pytest.approx(0.05)
    adam = digits_tf.build_optimizer("adam(lr=1e-3,betas=0.8/0.95,eps=1e-6)", 0.05)
    cfg = adam.get_config()
    assert isinstance(adam, tf.keras.optimizers.Adam) and cfg["learning_rate"] == pytest.approx(1e-3)
    assert (cfg["beta_1"], cfg["beta_2"], cfg["epsilon"]) == (pytest.approx(0.8), pytest.approx(0.95), pytest.approx(1e-6))
    with pytest.raises(ValueError, match="optimizer adamw: tensorflow.keras.optimizers.AdamW rejected its options"):
        digits_tf.build_optimizer("adamw(nosuch=1)", 0.05)
    try:
        import tf_backend.optim as optim
        present = hasattr(optim, "FrozenVarianceAdamW")
    except ImportError:
        present = False
    if present:
        opt = digits_tf.build_optimizer("frozen-adamw(freeze_step=5,weight_decay=0)", 1e-3)
        assert opt.get_config()["learning_rate"] == pytest.approx(1e-3)
    else:
        with pytest.raises(ValueError, match="tf_backend.optim.FrozenVarianceAdamW is not available in this checkout"):
            digits_tf.build_optimizer("frozen-adamw(freeze_step=5)", 1e-3)

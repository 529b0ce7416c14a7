"""TensorBoard text written from Python: the run/start card."""

import tensorflow as tf

from trainer.observe import summaries


def test_the_run_card_is_a_text_card_tensorboard_renders(tmp_path):
    writer = summaries.summary_writer(str(tmp_path))
    card = summaries.run_card(
        {"model": "cnn", "train_flags": ["a|b", "`c`"]},
        {"ps": ["h0:1"], "worker": ["h1:2", "h2:3"]}, {"host": "vm"}, 40)
    summaries.write_text(writer, 40, summaries.RUN_TEXT_TAG, card)
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    values = [(event.step, value)
              for event in tf.compat.v1.train.summary_iterator(str(path))
              for value in event.summary.value]
    assert len(values) == 1
    step, value = values[0]
    assert step == 40 and value.tag == summaries.RUN_TEXT_TAG
    assert value.metadata.plugin_data.plugin_name == "text"
    text = tf.make_ndarray(value.tensor).item().decode()
    assert text == card
    assert "started at global step 40" in text
    assert "| worker | `h1:2, h2:3` |" in text
    assert "| model | `cnn` |" in text
    # A cell's | and ` would end the cell or the code span.
    assert '| train_flags | `["a\\|b", "\'c\'"]` |' in text

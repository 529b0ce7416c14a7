"""The update rules' table (trainer/learning/optim.py): every optimizer the
settings accept has a rule, and a name it lacks is one line naming it and
the known ones."""

import pytest

from trainer.common import config as config_lib
from trainer.common.config import OPTIMIZERS, TrainConfig
from trainer.common.errors import UserError
from trainer.learning import optim


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_accepted_optimizer_has_a_rule(name):
    rule = optim.update_rule(TrainConfig(logdir="x", optimizer=name))
    assert callable(rule.optimizer)


def test_an_unknown_optimizer_is_one_line_naming_it_and_the_known_ones():
    config = TrainConfig(logdir="x", optimizer="lamb")
    with pytest.raises(UserError) as error:
        optim.update_rule(config)
    message = str(error.value)
    assert "\n" not in message
    assert message == ("--optimizer=lamb is unknown; choose one of "
                       f"{', '.join(OPTIMIZERS)}")
    with pytest.raises(UserError) as refused:  # the same words as the config
        config_lib.validate(config, 1)
    assert str(refused.value) == message

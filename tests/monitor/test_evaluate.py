from draft_align.monitor.evaluate import eos_ids


def test_eos_ids():
    class Tok:
        eos_token_id = 7

    class Gen:
        eos_token_id = [2, 9]

    class Model:
        generation_config = Gen()

    assert eos_ids(Model(), Tok()) == {2, 7, 9}
    assert eos_ids(Model(), None) == {2, 9}

from ladle.train import schedule


def test_every_rank_gets_the_same_number_of_micro_batches():
    batch = schedule.global_batch_rows(3, rows=103, global_batch=16, seed=1)
    per_rank = [schedule.micro_batches(batch, r, 2, 4) for r in range(2)]
    assert [len(m) for m in per_rank] == [2, 2]
    assert sorted(i for m in per_rank for mb in m for i in mb) == sorted(batch)


def test_order_is_deterministic_and_covers_an_epoch_without_repeats():
    rows, gb = 50, 8
    epoch = [i for s in range(schedule.steps_per_epoch(rows, gb)) for i in schedule.global_batch_rows(s, rows, gb, 7)]
    assert len(epoch) == len(set(epoch)) == 48
    assert schedule.global_batch_rows(2, rows, gb, 7) == schedule.global_batch_rows(2, rows, gb, 7)
    assert schedule.global_batch_rows(6, rows, gb, 7) != schedule.global_batch_rows(
        0, rows, gb, 7
    )  # next epoch reshuffles


def test_total_steps():
    assert schedule.total_steps(100, 8, 5, 3.0) == 5
    assert schedule.total_steps(100, 8, -1, 1.5) == 18  # 12 full steps per epoch

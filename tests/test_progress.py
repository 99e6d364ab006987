"""sparseconv.progress: the one-line progress of work done layer by layer."""
import io

from sparseconv.progress import NAME_WIDTH, StepLine, count_line, ptxas_counter


def test_each_step_rewrites_the_line_and_the_end_closes_it():
    out = io.StringIO()
    with StepLine("timing", 2, file=out) as line:
        line.step("layer1.0.conv1")
        line.step("a" * (NAME_WIDTH + 10))  # cut to NAME_WIDTH, so the line keeps its length
    steps = out.getvalue().split("\r")[1:]
    assert steps[0] == f"timing: 1/2 {'layer1.0.conv1':{NAME_WIDTH}s}"
    assert steps[1] == f"timing: 2/2 {'a' * NAME_WIDTH}\n"


def test_close_ends_the_line_once():
    out = io.StringIO()
    line = StepLine("timing", 1, file=out)
    line.step("conv1")
    line.close()
    line.close()
    assert out.getvalue() == f"\rtiming: 1/1 {'conv1':{NAME_WIDTH}s}\n"


def test_silent_when_off_or_when_there_is_nothing_to_do():
    for enabled, total in ((False, 3), (True, 0)):
        out = io.StringIO()
        with StepLine("tuning", total, enabled, file=out) as line:
            for name in ["x"] * total:
                line.step(name)
        assert out.getvalue() == ""


def test_count_line_counts_in_place_and_ends_at_the_total():
    out = io.StringIO()
    report = count_line("fc7: ptxas, functions assembled", file=out)
    for done in range(3):
        report(done, 2)
    assert out.getvalue() == ("\rfc7: ptxas, functions assembled: 0/2\rfc7: ptxas, functions assembled: 1/2"
                              "\rfc7: ptxas, functions assembled: 2/2\n")
    assert count_line("quiet", enabled=False) is None



def test_ptxas_counter_names_the_layer_and_its_variant(capsys):
    ptxas_counter("fc7", True, 1, 2)(3, 3)
    ptxas_counter("conv1")(1, 4)
    assert capsys.readouterr().err == ("\rfc7 (variant 2 of 2): ptxas, functions assembled: 3/3\n"
                                       "\rconv1: ptxas, functions assembled: 1/4")
    assert ptxas_counter("quiet", False) is None

from ladle.machine.topology import parse_gpu_query, probe
from tests.helpers import A100_X8, T4_X2


def test_cpu_host_reports_no_gpus_with_warning():
    topo = probe(env={}, query_output="")
    assert topo.gpu_count == 0
    assert topo.cuda_available is False
    assert topo.interconnect == "none"
    assert any("no CUDA GPU" in w for w in topo.warnings)


def test_parse_recorded_query():
    gpus = parse_gpu_query(A100_X8)
    assert len(gpus) == 8
    assert gpus[3].name == "NVIDIA A100-SXM4-80GB"
    assert gpus[3].memory_mib == 81920
    assert gpus[3].compute_capability == "8.0"


def test_cuda_visible_devices_filters_and_orders():
    topo = probe(env={"CUDA_VISIBLE_DEVICES": "5,2"}, query_output=A100_X8)
    assert [g.index for g in topo.gpus] == [5, 2]
    assert topo.gpu_count == 2


def test_cuda_visible_devices_stops_at_invalid_entry():
    topo = probe(env={"CUDA_VISIBLE_DEVICES": "1,9,0"}, query_output=T4_X2)
    assert [g.index for g in topo.gpus] == [1]


def test_nodes_from_launcher_env():
    topo = probe(env={"NNODES": "2", "NODE_RANK": "1"}, query_output=T4_X2)
    assert (topo.nodes, topo.node_rank) == (2, 1)

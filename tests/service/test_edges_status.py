"""Issue 22 #12: statuses that say what is going on."""

from __future__ import annotations

import grpc

from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb

from service_helpers import ask
from test_drain import slow_put


def test_generate_on_a_building_context_says_it_is_building(start):
    srv, client = start()
    info = client.put(slow_put("abc " * 100, False), timeout=10).context
    try:
        ask(client, info.context_id)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "BUILDING" in err.details()
    else:
        raise AssertionError("Generate on a BUILDING context must fail")


def test_admin_on_the_main_port_names_the_admin_port(start):
    srv, client = start(admin_port=0)
    main_only = Client(f"127.0.0.1:{srv.port}")
    try:
        main_only.admin.Stats(apb.StatsRequest(), timeout=5)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED and str(srv.admin_port) in err.details()
    else:
        raise AssertionError("admin on the main port must be refused")
    finally:
        main_only.close()

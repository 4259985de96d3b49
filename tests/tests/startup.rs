//! Start-up in three steps, in this process: `Node::build` makes what stowd
//! holds, `Listeners::bind` binds its sockets, `server::run` serves the node
//! on them until shutdown. Real sockets and the real TransferQueue and
//! `stowage/1` wire formats. Every endpoint reaches one store through a
//! manager: a row put at a unit endpoint is read through the router and the
//! native endpoint, a row put at the native endpoint is read at its unit's
//! endpoint, and a unit endpoint's checkpoint (a manager operation) round
//! trips.

use std::time::Duration;

use stowage_host::batch::Field;
use stowage_host::config::Config;
use stowage_host::node::Node;
use stowage_host::server::{Listeners, UnitEndpoint, run};
use stowage_host::wire::tq;
use stowage_tests::data::{assert_cells, cells, f32_rows, wire_cells};
use stowage_tests::{NativeClient, TqClient, plugin_dir, shared_cache, temp_dir};

fn config(roots: &std::path::Path) -> Config {
    let mut c = Config::default();
    c.plugins.dir = Some(plugin_dir());
    c.plugins.cache_dir = Some(shared_cache());
    c.plugins.watch = false;
    c.shm.enabled = false;
    c.units.local = 2;
    c.router.enabled = true;
    c.checkpoint.roots = vec![roots.to_path_buf()];
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn build_bind_run_and_shut_down() {
    let dir = temp_dir("startup");
    let config = config(&dir);
    let node = Node::build(&config).await.expect("build the node");
    assert_eq!(node.units.len(), 2);
    assert_eq!(node.unit_managers.len(), 2);
    assert_eq!(node.manager.targets().len(), 2);
    for (unit, m) in node.units.iter().zip(&node.unit_managers) {
        // Each unit endpoint's manager is over that unit alone.
        assert!(std::sync::Arc::ptr_eq(
            unit,
            m.unit().expect("a unit's own manager")
        ));
    }
    assert!(node.manager.unit().is_none(), "the node's manager routes");
    let ids: Vec<String> = node.units.iter().map(|u| u.id().to_string()).collect();

    let listeners = Listeners::bind(&config, &node).await.expect("bind");
    let endpoints = listeners.endpoints(&node);
    assert_eq!(endpoints.pid, std::process::id());
    assert_eq!(
        endpoints
            .units
            .iter()
            .map(|u| u.id.clone())
            .collect::<Vec<_>>(),
        ids
    );
    let router: UnitEndpoint = endpoints.router.clone().expect("router enabled");
    assert!(endpoints.shm_dir.is_none() && endpoints.metrics.is_none());

    let (shutdown, stop) = tokio::sync::watch::channel(false);
    let served = tokio::spawn(run(listeners, node, stop));

    // Put at unit 0's endpoint: stored as it arrived, in the one store.
    let unit0 = TqClient::new(&endpoints.units[0]);
    let a = Field::Regular(f32_rows(2, 8, 1));
    unit0.put_ok(&[0, 2], vec![("a".into(), a.clone())]).await;
    // Read through the router (g % 2 = 0: unit 0) and the native endpoint.
    let via_router = TqClient::new(&router).get_ok(&[0, 2], &["a"]).await;
    assert_cells("router get", &via_router[0].1, &cells(&a));
    let native = NativeClient::new(&endpoints.native);
    let mut got = native.get_ok(&[2, 0], &["a"]).await;
    let want = [cells(&a)[1].clone(), cells(&a)[0].clone()];
    assert_cells("native get", &wire_cells(got.remove(0).1), &want);

    // Put at the native endpoint, through the node's manager and its
    // chains: row 1 goes to unit 1, and unit 1's endpoint serves it.
    let b = Field::Regular(f32_rows(1, 4, 2));
    native.put_ok(&[1], &[("b".into(), b.clone())]).await;
    let unit1 = TqClient::new(&endpoints.units[1]);
    assert_cells(
        "unit 1 get",
        &unit1.get_ok(&[1], &["b"]).await[0].1,
        &cells(&b),
    );

    // A unit endpoint's SAVE and LOAD: manager operations on that unit.
    let file = dir.join("unit0.safetensors");
    let path = file.to_string_lossy().into_owned();
    let saved = unit0
        .request(&tq::Request::SaveCheckpoint { path: path.clone() })
        .await;
    assert_eq!(
        saved,
        tq::Reply::Checkpoint {
            load: false,
            error: None
        }
    );
    assert!(file.exists());
    unit0.clear(&[0, 2]).await;
    assert_eq!(native.stat("rows").await, 1, "only row 1 is left");
    let loaded = unit0.request(&tq::Request::LoadCheckpoint { path }).await;
    assert_eq!(
        loaded,
        tq::Reply::Checkpoint {
            load: true,
            error: None
        }
    );
    let mut got = native.get_ok(&[0, 2], &["a"]).await;
    assert_cells("loaded", &wire_cells(got.remove(0).1), &cells(&a));

    // Shutdown: run returns once every service has stopped.
    shutdown.send(true).expect("run is listening");
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("run returns after shutdown")
        .expect("run did not panic");
}

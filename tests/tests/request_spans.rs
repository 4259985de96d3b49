//! Tracing: with `RUST_LOG=debug` the real `stowd` logs one `request` span
//! per request, carrying the request id and op, and the policy decisions
//! of that request inside it (issue 18's check). A put and a get go over
//! the native protocol with a fixed request id each, and a put and a get
//! over the router's TransferQueue endpoint with a fixed `request_id` each;
//! the log lines are then read back from the process's stderr.

use stowage_host::batch::Field;
use stowage_host::wire::native;
use stowage_host::wire::tq;
use stowage_tests::data::f32_rows;
use stowage_tests::{NativeClient, Stowd, TqClient};

/// The log lines that are inside (or close) the span whose fields contain
/// every one of `fields`.
fn lines_in<'a>(log: &'a str, fields: &[&str]) -> Vec<&'a str> {
    log.lines()
        .filter(|l| {
            let Some(at) = l.find("request{") else {
                return false;
            };
            let span = &l[at..l[at..].find('}').map(|e| at + e).unwrap_or(l.len())];
            fields.iter().all(|f| span.contains(f))
        })
        .collect()
}

/// Asserts one closed `request` span with `fields`, and a policy decision
/// of the selection chain inside it (a put) or none needed (a get).
fn assert_span(log: &str, fields: &[&str], with_selection: bool) {
    let lines = lines_in(log, fields);
    // The request span's own close line: no inner span after its fields.
    let closes: Vec<&&str> = lines
        .iter()
        .filter(|l| {
            let at = l.find("request{").unwrap_or(0);
            let rest = &l[at + l[at..].find('}').unwrap_or(0)..];
            rest.starts_with("}: stowage_host::server::") && rest.contains(": close")
        })
        .collect();
    assert_eq!(
        closes.len(),
        1,
        "one closed request span with {fields:?}, got {closes:?}\n--- log ---\n{log}"
    );
    assert!(
        lines.iter().any(|l| l.contains("rows=4")),
        "rows recorded: {lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("bytes=")),
        "bytes recorded: {lines:?}"
    );
    if with_selection {
        let decisions: Vec<&&str> = lines
            .iter()
            .filter(|l| l.contains("policy{chain=\"select\"") && l.contains("policy decision"))
            .collect();
        assert!(
            !decisions.is_empty(),
            "a selection decision inside {fields:?}: {lines:?}\n--- log ---\n{log}"
        );
        // The default chain's first plugin takes a contiguous put of a
        // regular field; its name and version are in the decision.
        assert!(
            decisions.iter().any(|l| l.contains("decided_by=plugin ")),
            "{decisions:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.contains("plugin{plugin=") && l.contains("version=")),
            "a plugin span (name, version) inside {fields:?}: {lines:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_log_has_one_span_per_request_with_the_policy_decisions_inside() {
    let stowd = Stowd::start_with_log("debug", "");
    let fields = vec![("obs".to_string(), Field::Regular(f32_rows(4, 8, 1)))];

    // Native: a put and a get with request ids of our own.
    let client = NativeClient::new(stowd.native());
    let wire: Vec<(std::sync::Arc<str>, native::WireField)> = fields
        .iter()
        .map(|(n, f)| (n.as_str().into(), native::WireField::from_field(f).unwrap()))
        .collect();
    let put = native::Request {
        id: 770_001,
        op: native::Op::Put {
            global_indexes: vec![0, 1, 2, 3],
            fields: wire,
        },
    };
    let (id, reply) = client
        .send_frames(native::encode_request(&put).unwrap())
        .await;
    assert_eq!(id, 770_001);
    assert!(
        matches!(reply, native::Reply::PutOk { rows: 4 }),
        "{reply:?}"
    );
    let get = native::Request {
        id: 770_002,
        op: native::Op::Get {
            global_indexes: vec![0, 1, 2, 3].into(),
            fields: vec!["obs".into()],
        },
    };
    let (_, reply) = client
        .send_frames(native::encode_request(&get).unwrap())
        .await;
    assert!(matches!(reply, native::Reply::GetOk { .. }), "{reply:?}");

    // TransferQueue, through the router: request ids of our own.
    let router = stowd.router();
    let tq_client = TqClient::new(router);
    let send = |request: &tq::Request, request_id: &str| {
        let stamp = tq::Stamp::new(request_id, 1.0);
        tq::encode_request_stamped("TQ_STORAGE_tracing_test", Some(&router.id), request, &stamp)
            .unwrap()
    };
    let put = tq::Request::Put {
        global_indexes: vec![10, 11, 12, 13],
        fields: fields.clone(),
    };
    let reply = tq_client.send_frames(send(&put, "a1b2c3d4")).await;
    assert!(matches!(reply, tq::Reply::PutData), "{reply:?}");
    let get = tq::Request::Get {
        global_indexes: vec![10, 11, 12, 13],
        fields: vec!["obs".into()],
    };
    let reply = tq_client.send_frames(send(&get, "e5f6a7b8")).await;
    assert!(matches!(reply, tq::Reply::GetData { .. }), "{reply:?}");

    // The spans close after the replies are sent: wait for the last one.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while lines_in(&stowd.full_log(), &["id=\"e5f6a7b8\""])
        .iter()
        .all(|l| !l.contains("}: stowage_host::server::tq: close"))
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let log = stowd.full_log();
    assert_span(&log, &["proto=\"native\"", "id=770001", "op=\"put\""], true);
    assert_span(
        &log,
        &["proto=\"native\"", "id=770002", "op=\"get\""],
        false,
    );
    assert_span(
        &log,
        &["proto=\"tq_router\"", "id=\"a1b2c3d4\"", "op=\"put\""],
        true,
    );
    assert_span(
        &log,
        &["proto=\"tq_router\"", "id=\"e5f6a7b8\"", "op=\"get\""],
        false,
    );
}

// Templates every tenant starts sandboxes from; for admin keys, their builds (with the log
// streamed as it is written) and deletes.
import { useEffect, useRef, useState } from "preact/hooks";
import { get, json, stream } from "../api.js";
import { Confirm, Dialog, Empty, ErrorBox, Field, PageHeader, Spinner, StateBadge, ago, bytes, link, usePoll, when } from "../ui.jsx";

function BuildDialog({ id, onClose, onStarted }) {
  const [name, setName] = useState(id || "");
  const [spec, setSpec] = useState(`[template]\nname = "${id || "my-template"}"\nfrom = "debian:bookworm"\n\n[[steps]]\nrun = "echo hello > /etc/motd"\n`);
  const [context, setContext] = useState(null);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      let encoded = "";
      if (context) {
        const raw = new Uint8Array(await context.arrayBuffer());
        let text = "";
        for (let i = 0; i < raw.length; i += 0x8000) text += String.fromCharCode(...raw.subarray(i, i + 0x8000));
        encoded = btoa(text);
      }
      await json("POST", `/v1/templates/${encodeURIComponent(name)}/builds`, { body: { spec, context: encoded } });
      onStarted(name);
    } catch (err) {
      setError(err);
      setBusy(false);
    }
  };
  return (
    <Dialog
      title={id ? `Rebuild ${id}` : "Build a template"}
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="build" disabled={busy || !name}>
            {busy ? <Spinner label="Queuing" /> : "Build"}
          </button>
        </>
      }
    >
      <form id="build" onSubmit={submit}>
        {!id && (
          <Field label="Template id" hint="lower-case letters, digits, . _ -">
            <input
              name="template-id"
              value={name}
              onInput={(e) => {
                // The spec names its template too; they must agree.
                setName(e.target.value);
                setSpec(spec.replace(/^name = ".*"$/m, `name = "${e.target.value}"`));
              }}
            />
          </Field>
        )}
        <Field label="space.toml" hint="see docs/templates.md">
          <textarea name="spec" class="mono" rows="10" value={spec} onInput={(e) => setSpec(e.target.value)} />
        </Field>
        <Field label="Build context (optional)" hint="a .tar or .tar.gz of the files its copy steps name">
          <input type="file" accept=".tar,.tgz,.tar.gz" onChange={(e) => setContext(e.target.files[0] || null)} />
        </Field>
      </form>
      <ErrorBox error={error} title="Build not started" />
    </Dialog>
  );
}

export function Templates({ me }) {
  const { data, error, loading } = usePoll(() => get("/v1/templates"), 5000);
  const [building, setBuilding] = useState(false);
  const items = data?.items || [];
  return (
    <section>
      <PageHeader title="Templates" subtitle="Root file systems sandboxes start from; shared by every tenant.">
        {me.admin && (
          <button class="primary" onClick={() => setBuilding(true)}>
            Build a template
          </button>
        )}
      </PageHeader>
      <ErrorBox error={error} title="Templates not loaded" />
      {loading && !data ? (
        <Spinner label="Loading templates" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No templates">Build one with `space template build` or, with an admin key, here.</Empty>
        </div>
      ) : (
        <div class="card">
          <table class="table" id="templates">
            <thead>
              <tr>
                <th>Template</th>
                <th>State</th>
                <th>Size</th>
                <th>Built</th>
                <th>Warm pool</th>
              </tr>
            </thead>
            <tbody>
              {items.map((t) => (
                <tr key={t.id}>
                  <td>
                    <a href={link(`/templates/${t.id}`)}>{t.id}</a>
                  </td>
                  <td>
                    <StateBadge state={t.state} />
                  </td>
                  <td class="muted">{t.built?.size_bytes ? bytes(t.built.size_bytes) : "—"}</td>
                  <td class="muted">{t.built?.built_at ? ago(t.built.built_at) : "—"}</td>
                  <td class="muted">{t.pool.size ? `${t.pool.ready} of ${t.pool.size} ready` : "off"}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      {building && <BuildDialog onClose={() => setBuilding(false)} onStarted={(id) => (location.hash = `#/templates/${id}`)} />}
    </section>
  );
}

function BuildLog({ id, state }) {
  const [text, setText] = useState("");
  const [error, setError] = useState(null);
  const [following, setFollowing] = useState(true);
  const pre = useRef(null);
  useEffect(() => {
    const abort = new AbortController();
    setText("");
    setError(null);
    setFollowing(true);
    stream(`/v1/templates/${encodeURIComponent(id)}/build/log`, (chunk) => setText((t) => t + chunk), abort.signal)
      .catch((e) => e.name !== "AbortError" && setError(e))
      .finally(() => setFollowing(false));
    return () => abort.abort();
  }, [id, state === "building"]);
  useEffect(() => {
    if (pre.current) pre.current.scrollTop = pre.current.scrollHeight;
  }, [text]);
  if (error) return <ErrorBox error={error} title={error.status === 404 ? "No build log" : "Build log not read"} />;
  return (
    <div class="card">
      <div class="terminal-bar">
        <span class={`status status-${following ? "live" : "ended"}`}>
          <span class="dot" />
          {following ? "Following the build" : "The build has ended"}
        </span>
      </div>
      <pre class="log" ref={pre} id="build-log">
        {text || (following ? "Waiting for output…" : "(empty)")}
      </pre>
    </div>
  );
}

export function Template({ id, me }) {
  const { data: t, error, reload } = usePoll(() => get(`/v1/templates/${encodeURIComponent(id)}`), 3000, [id]);
  const [building, setBuilding] = useState(false);
  const [deleting, setDeleting] = useState(false);
  if (error && !t) return <ErrorBox error={error} title="Template not loaded" />;
  if (!t) return <Spinner label="Loading" />;
  const built = t.built || {};
  return (
    <section>
      <div class="crumbs">
        <a href="#/templates">Templates</a> / {id}
      </div>
      <PageHeader
        title={
          <>
            {t.id} <StateBadge state={t.state} />
          </>
        }
        subtitle={t.error || (built.built_at ? `built ${ago(built.built_at)}` : "")}
      >
        {me.admin && t.id !== "base" && (
          <>
            <button class="ghost" onClick={() => setBuilding(true)}>
              Rebuild
            </button>
            <button class="danger" onClick={() => setDeleting(true)}>
              Delete
            </button>
          </>
        )}
      </PageHeader>
      <div class="card">
        <dl class="details">
          {[
            ["Digest", built.digest ? <code>{built.digest.slice(0, 16)}</code> : "—"],
            ["Source", built.source || "—"],
            ["Size", built.size_bytes ? bytes(built.size_bytes) : "—"],
            ["Build time", built.build_seconds ? `${built.build_seconds.toFixed(1)} s` : "—"],
            ["Steps", (built.steps || []).join(" · ") || "—"],
            ["Worker", t.worker_id || "every worker"],
            ["Warm pool", t.pool.size ? `${t.pool.ready} ready, ${t.pool.starting} starting, of ${t.pool.size}` : "off"],
            ["Updated", when(t.updated_at)],
          ].map(([k, v]) => (
            <div key={k}>
              <dt>{k}</dt>
              <dd>{v}</dd>
            </div>
          ))}
        </dl>
      </div>
      <h2 class="section">Build log</h2>
      {me.admin ? t.build_id ? <BuildLog id={id} state={t.state} /> : <div class="card pad muted">This template was not built through the API, so it has no build log here.</div> : <div class="card pad muted">Build logs are shown to admin keys.</div>}
      {building && <BuildDialog id={id} onClose={() => setBuilding(false)} onStarted={() => { setBuilding(false); reload(); }} />}
      {deleting && (
        <Confirm title={`Delete ${id}?`} action="Delete" danger onClose={() => setDeleting(false)} onConfirm={async () => { await json("DELETE", `/v1/templates/${encodeURIComponent(id)}`); location.hash = "#/templates"; }}>
          <p>Its images, base snapshots and warm pool go. Sandboxes that use it must be deleted first.</p>
        </Confirm>
      )}
    </section>
  );
}

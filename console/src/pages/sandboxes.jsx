// Every sandbox of the tenant, live, with filters; and a new one.
import { useState } from "preact/hooks";
import { get, json } from "../api.js";
import { Confirm, Dialog, Empty, ErrorBox, Field, PageHeader, Spinner, StateBadge, ago, link, mib, pairs, usePoll } from "../ui.jsx";

const STATES = ["running", "paused", "suspended", "pending", "starting", "error", "deleted"];
const REFRESH_MS = 3000;

function Usage() {
  const { data } = usePoll(() => get("/v1/quotas"), 10000);
  if (!data) return null;
  const { used, quotas } = data;
  const meter = (label, u, q, fmt = String) => (
    <div class="meter" key={label}>
      <div class="meter-label">
        <span>{label}</span>
        <span class="muted">
          {fmt(u)} / {fmt(q)}
        </span>
      </div>
      <div class="meter-bar">
        {/* Set through the CSSOM, which the page's CSP allows (a style attribute it would not). */}
        <div class={`meter-fill ${u >= q ? "full" : ""}`} style={{ width: `${Math.min(100, (100 * u) / Math.max(q, 1))}%` }} />
      </div>
    </div>
  );
  return (
    <div class="meters">
      {meter("Sandboxes", used.sandboxes, quotas.sandboxes)}
      {meter("vCPUs", used.vcpus, quotas.vcpus)}
      {meter("Memory", used.memory_mib, quotas.memory_mib, mib)}
      {meter("Volumes", used.volumes, quotas.volumes)}
    </div>
  );
}

// The volumes to mount and the secrets to bind, a row each: checked to use it.
function Mounts({ volumes, mounts, setMounts }) {
  if (!volumes.length) return <p class="muted small">No volumes yet (Volumes makes one).</p>;
  return volumes.map((v) => {
    const m = mounts[v.id];
    const put = (change) => setMounts({ ...mounts, [v.id]: { ...(m || { path: `/mnt/${v.name || v.id}`, read_only: false, on: false }), ...change } });
    return (
      <div class="pick" key={v.id} data-volume={v.id}>
        <label class="check">
          <input type="checkbox" name={`mount-${v.id}`} checked={!!m?.on} onChange={(e) => put({ on: e.target.checked })} /> {v.name || v.id}
        </label>
        <input name={`mount-path-${v.id}`} aria-label="Mount path" value={m?.path ?? `/mnt/${v.name || v.id}`} onInput={(e) => put({ path: e.target.value, on: true })} />
        <label class="check small">
          <input type="checkbox" name={`mount-ro-${v.id}`} checked={!!m?.read_only} onChange={(e) => put({ read_only: e.target.checked })} /> read-only
        </label>
      </div>
    );
  });
}

function Bindings({ secrets, bound, setBound }) {
  if (!secrets.length) return <p class="muted small">No secrets yet (Secrets makes one).</p>;
  return secrets.map((x) => {
    const b = bound[x.name];
    const fallback = { hosts: "", env: x.name.toUpperCase().replace(/[^A-Z0-9_]/g, "_"), on: false };
    const put = (change) => setBound({ ...bound, [x.name]: { ...(b || fallback), ...change } });
    return (
      <div class="pick" key={x.name} data-secret={x.name}>
        <label class="check">
          <input type="checkbox" name={`secret-${x.name}`} checked={!!b?.on} onChange={(e) => put({ on: e.target.checked })} /> {x.name}
        </label>
        <input name={`secret-hosts-${x.name}`} aria-label="Hosts it is for" placeholder="for hosts: api.example.com" value={b?.hosts ?? ""} onInput={(e) => put({ hosts: e.target.value, on: true })} />
        <input name={`secret-env-${x.name}`} aria-label="Variable" placeholder="VARIABLE" value={b?.env ?? fallback.env} onInput={(e) => put({ env: e.target.value })} />
      </div>
    );
  });
}

function CreateDialog({ onClose, onCreated }) {
  const templates = usePoll(() => get("/v1/templates"), 0);
  const volumes = usePoll(() => get("/v1/volumes"), 0);
  const secrets = usePoll(() => get("/v1/secrets"), 0);
  const [mounts, setMounts] = useState({});
  const [bound, setBound] = useState({});
  const [form, setForm] = useState({ template: "base", vcpus: 1, memory_mib: 256, disk_mib: 1024, timeout_s: 300, timeout_action: "pause", metadata: "", env: "", egress: "default", hosts: "" });
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const set = (k) => (e) => setForm({ ...form, [k]: e.target.value });
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      const body = {
        template: form.template,
        vcpus: Number(form.vcpus),
        memory_mib: Number(form.memory_mib),
        disk_mib: Number(form.disk_mib),
        timeout_s: Number(form.timeout_s),
        timeout_action: form.timeout_action,
        metadata: pairs(form.metadata),
        env: pairs(form.env),
        volumes: Object.entries(mounts)
          .filter(([, m]) => m.on)
          .map(([volume, m]) => ({ volume, path: m.path, read_only: m.read_only })),
        secrets: Object.entries(bound)
          .filter(([, b]) => b.on)
          .map(([secret, b]) => ({ secret, hosts: b.hosts.split(/[\s,]+/).filter(Boolean), env: b.env })),
      };
      const hosts = form.hosts.split(/[\s,]+/).filter(Boolean);
      // The deployment's default policy, only the hosts named (and those of bound secrets), or nothing out at all.
      if (form.egress === "hosts") body.network = { hosts: hosts.map((pattern) => ({ pattern })) };
      if (form.egress === "none") body.network = { hosts: [] };
      const sb = await json("POST", "/v1/sandboxes", { body });
      onCreated(sb);
    } catch (err) {
      setError(err);
      setBusy(false);
    }
  };
  const usable = (templates.data?.items || []).filter((t) => t.state === "ready");
  return (
    <Dialog
      title="New sandbox"
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="create-sandbox" disabled={busy}>
            {busy ? <Spinner label="Starting" /> : "Create sandbox"}
          </button>
        </>
      }
    >
      <form id="create-sandbox" class="grid2" onSubmit={submit}>
        <Field label="Template">
          <select name="template" value={form.template} onChange={set("template")}>
            {(usable.length ? usable : [{ id: "base" }]).map((t) => (
              <option key={t.id} value={t.id}>
                {t.id}
              </option>
            ))}
          </select>
        </Field>
        <Field label="vCPUs">
          <input name="vcpus" type="number" min="1" max="64" value={form.vcpus} onInput={set("vcpus")} />
        </Field>
        <Field label="Memory (MiB)">
          <input name="memory_mib" type="number" min="128" step="64" value={form.memory_mib} onInput={set("memory_mib")} />
        </Field>
        <Field label="Disk (MiB)">
          <input name="disk_mib" type="number" min="256" step="256" value={form.disk_mib} onInput={set("disk_mib")} />
        </Field>
        <Field label="Timeout (s)">
          <input name="timeout_s" type="number" min="1" value={form.timeout_s} onInput={set("timeout_s")} />
        </Field>
        <Field label="When it times out">
          <select name="timeout_action" value={form.timeout_action} onChange={set("timeout_action")}>
            <option value="pause">pause</option>
            <option value="suspend">suspend</option>
            <option value="delete">delete</option>
          </select>
        </Field>
        <Field label="Metadata" hint="key=value, one per line or comma-separated">
          <textarea name="metadata" rows="2" value={form.metadata} onInput={set("metadata")} placeholder="team=search" />
        </Field>
        <Field label="Environment" hint="KEY=value, one per line or comma-separated">
          <textarea name="env" rows="2" value={form.env} onInput={set("env")} placeholder="MODE=test" />
        </Field>
        <Field label="Egress" hint="what the sandbox may reach through its gateway">
          <select name="egress" value={form.egress} onChange={set("egress")}>
            <option value="default">the deployment's default</option>
            <option value="hosts">only the hosts named</option>
            <option value="none">nothing</option>
          </select>
        </Field>
        {form.egress === "hosts" && (
          <Field label="Allowed hosts" hint="names or *.names; everything else is refused">
            <textarea name="hosts" rows="2" value={form.hosts} onInput={set("hosts")} placeholder="pypi.org *.pythonhosted.org" />
          </Field>
        )}
        <fieldset class="wide">
          <legend>Volumes</legend>
          <Mounts volumes={(volumes.data?.items || []).filter((v) => v.state === "available")} mounts={mounts} setMounts={setMounts} />
        </fieldset>
        <fieldset class="wide">
          <legend>Secrets</legend>
          <p class="muted small">The guest sees a placeholder in the variable; the gateway puts the value in requests to the hosts named.</p>
          <Bindings secrets={secrets.data?.items || []} bound={bound} setBound={setBound} />
        </fieldset>
      </form>
      <ErrorBox error={error} title="Not created" />
    </Dialog>
  );
}

const ACTIONS = {
  pause: { label: "Pause", from: ["running"] },
  resume: { label: "Resume", from: ["paused", "suspended"] },
  suspend: { label: "Suspend", from: ["running", "paused"] },
  delete: { label: "Delete", from: null },
};

// Asks each sandbox at once (without waiting for the change to finish); what each answered.
async function act(verb, ids) {
  const asked = ids.map((id) =>
    verb === "delete"
      ? json("DELETE", `/v1/sandboxes/${id}`, { query: { wait: "false" } })
      : json("POST", `/v1/sandboxes/${id}/${verb}`, { query: { wait: "false" } }),
  );
  const results = await Promise.allSettled(asked);
  return results.map((r, i) => ({ id: ids[i], error: r.status === "rejected" ? r.reason.message : null }));
}

function Selection({ selected, items, onDone }) {
  const [confirming, setConfirming] = useState(false);
  const [busy, setBusy] = useState(false);
  const [outcome, setOutcome] = useState(null);
  const chosen = items.filter((sb) => selected.has(sb.id));
  const run = async (verb) => {
    setBusy(true);
    const ids = chosen.filter((sb) => !ACTIONS[verb].from || ACTIONS[verb].from.includes(sb.state)).map((sb) => sb.id);
    const done = await act(verb, ids);
    const failed = done.filter((d) => d.error);
    setOutcome({ verb, asked: done.length, skipped: chosen.length - ids.length, failed });
    setBusy(false);
    setConfirming(false);
    onDone();
  };
  return (
    <div class="bulk" role="toolbar" aria-label="Selected sandboxes">
      <strong>{chosen.length} selected</strong>
      {Object.entries(ACTIONS).map(([verb, a]) => (
        <button key={verb} class={verb === "delete" ? "danger small" : "ghost small"} disabled={busy || !chosen.length} onClick={() => (verb === "delete" ? setConfirming(true) : run(verb))}>
          {a.label}
        </button>
      ))}
      {busy && <Spinner label="Asking" />}
      {outcome && (
        <span class="muted small" id="bulk-outcome">
          {ACTIONS[outcome.verb].label}: {outcome.asked - outcome.failed.length} asked{outcome.skipped ? `, ${outcome.skipped} not in a state for it` : ""}
          {outcome.failed.length ? `, ${outcome.failed.length} refused (${outcome.failed.map((f) => `${f.id}: ${f.error}`).join("; ")})` : ""}
        </span>
      )}
      {confirming && (
        <Confirm title={`Delete ${chosen.length} sandbox(es)?`} action="Delete" danger onClose={() => setConfirming(false)} onConfirm={() => run("delete")}>
          <p>Each is stopped, and its disk, snapshots and checkpoints removed: {chosen.map((sb) => sb.id).join(", ")}.</p>
        </Confirm>
      )}
    </div>
  );
}

export function Sandboxes() {
  const [state, setState] = useState("");
  const [template, setTemplate] = useState("");
  const [metadata, setMetadata] = useState("");
  const [id, setId] = useState("");
  const [showDeleted, setShowDeleted] = useState(false);
  const [creating, setCreating] = useState(false);
  const [pages, setPages] = useState(1);
  const [selected, setSelected] = useState(new Set());
  let filterError = null;
  // Deleted sandboxes are history: left out unless asked for.
  const query = { state, template, limit: 50 * pages, deleted: String(showDeleted || state === "deleted") };
  if (id.trim()) query.id = id.trim();
  try {
    for (const [k, v] of Object.entries(pairs(metadata))) query[`metadata.${k}`] = v;
  } catch (e) {
    filterError = e;
  }
  const list = usePoll(() => get("/v1/sandboxes", { query }), REFRESH_MS, [state, template, metadata, pages, id, showDeleted]);
  const templates = usePoll(() => get("/v1/templates"), 0);
  const items = list.data?.items || [];
  const filtered = state || template || metadata || id;
  const live = items.filter((sb) => sb.state !== "deleted");
  const toggle = (sid, on) => {
    const next = new Set(selected);
    if (on) next.add(sid);
    else next.delete(sid);
    setSelected(next);
  };
  return (
    <section>
      <PageHeader title="Sandboxes" subtitle="MicroVMs of your tenant. The list refreshes by itself.">
        <span class={`live ${list.error ? "live-off" : ""}`}>{list.error ? "offline" : "live"}</span>
        <button class="primary" onClick={() => setCreating(true)}>
          New sandbox
        </button>
      </PageHeader>
      <Usage />
      <div class="toolbar">
        <select aria-label="State" name="state" value={state} onChange={(e) => setState(e.target.value)}>
          <option value="">Every state</option>
          {STATES.map((s) => (
            <option key={s} value={s}>
              {s}
            </option>
          ))}
        </select>
        <select aria-label="Template" name="template-filter" value={template} onChange={(e) => setTemplate(e.target.value)}>
          <option value="">Every template</option>
          {(templates.data?.items || []).map((t) => (
            <option key={t.id} value={t.id}>
              {t.id}
            </option>
          ))}
        </select>
        <input class="grow" name="metadata-filter" aria-label="Metadata filter" placeholder="Filter by metadata: key=value, …" value={metadata} onInput={(e) => setMetadata(e.target.value)} />
        <input name="id-filter" aria-label="Sandbox id" placeholder="Id starts with…" value={id} onInput={(e) => setId(e.target.value)} />
        <label class="check">
          <input type="checkbox" name="show-deleted" checked={showDeleted} onChange={(e) => setShowDeleted(e.target.checked)} /> deleted
        </label>
      </div>
      {selected.size > 0 && <Selection selected={selected} items={items} onDone={() => list.reload()} />}
      {filterError && <ErrorBox error={filterError} title="Filter not understood" />}
      <ErrorBox error={list.error} title="Sandboxes not loaded" />
      {list.loading && !list.data ? (
        <div class="card pad">
          <Spinner label="Loading sandboxes" />
        </div>
      ) : items.length === 0 ? (
        <div class="card">
          <Empty
            title={filtered ? "No sandbox matches" : "No sandboxes yet"}
            action={
              !filtered && (
                <button class="primary" onClick={() => setCreating(true)}>
                  Create your first sandbox
                </button>
              )
            }
          >
            {filtered ? "Change the filters to see more." : "A sandbox is a microVM of its own, started from a template in well under a second."}
          </Empty>
        </div>
      ) : (
        <div class="card scroll">
          <table class="table" id="sandbox-table">
            <thead>
              <tr>
                <th class="pick-col">
                  <input type="checkbox" name="select-all" aria-label="Select every sandbox shown" checked={live.length > 0 && live.every((sb) => selected.has(sb.id))} onChange={(e) => setSelected(new Set(e.target.checked ? live.map((sb) => sb.id) : []))} />
                </th>
                <th>Sandbox</th>
                <th>State</th>
                <th>Template</th>
                <th>Boot</th>
                <th>Size</th>
                <th>Age</th>
                <th>Metadata</th>
              </tr>
            </thead>
            <tbody>
              {items.map((sb) => (
                <tr key={sb.id} class={sb.state === "deleted" ? "dim" : ""} data-id={sb.id}>
                  <td class="pick-col">
                    {sb.state !== "deleted" && <input type="checkbox" name="select" aria-label={`Select ${sb.id}`} checked={selected.has(sb.id)} onChange={(e) => toggle(sb.id, e.target.checked)} />}
                  </td>
                  <td>
                    <a class="mono" href={link(`/sandboxes/${sb.id}`)}>
                      {sb.id}
                    </a>
                  </td>
                  <td>
                    <StateBadge state={sb.state} />
                  </td>
                  <td>{sb.template}</td>
                  <td>{sb.boot ? <span class={`boot boot-${sb.boot}`}>{sb.boot}</span> : <span class="muted">—</span>}</td>
                  <td class="muted">
                    {sb.vcpus} vCPU · {mib(sb.memory_mib)}
                  </td>
                  <td class="muted" title={sb.created_at}>
                    {ago(sb.created_at)}
                  </td>
                  <td>
                    {Object.entries(sb.metadata).map(([k, v]) => (
                      <button key={k} class="chip" title="Filter by this" onClick={() => setMetadata(`${k}=${v}`)}>
                        {k}={v}
                      </button>
                    ))}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
          {list.data?.next_cursor && (
            <div class="pad center">
              <button class="ghost" onClick={() => setPages(pages + 1)}>
                Show more
              </button>
            </div>
          )}
        </div>
      )}
      {creating && (
        <CreateDialog
          onClose={() => setCreating(false)}
          onCreated={(sb) => {
            setCreating(false);
            location.hash = `#/sandboxes/${sb.id}`;
          }}
        />
      )}
    </section>
  );
}

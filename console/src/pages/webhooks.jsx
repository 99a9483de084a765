// Webhooks: endpoints told when the tenant's sandboxes change, each delivery signed; the secret
// is shown once, when the endpoint is made. A webhook's deliveries list every attempt.
import { useState } from "preact/hooks";
import { get, json } from "../api.js";
import { Confirm, Dialog, Empty, ErrorBox, Field, PageHeader, Spinner, ago, usePoll } from "../ui.jsx";

const EVENTS = ["sandbox.created", "sandbox.running", "sandbox.paused", "sandbox.idle_paused", "sandbox.suspended", "sandbox.resumed", "sandbox.timed_out", "sandbox.failed", "sandbox.deleted"];
const DELIVERY = { delivered: "running", pending: "busy", failed: "error" }; // badge colours

function AddWebhook({ onClose, onMade }) {
  const [url, setUrl] = useState("");
  const [events, setEvents] = useState(new Set(EVENTS));
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const [made, setMade] = useState(null);
  const toggle = (e) => {
    const next = new Set(events);
    next.has(e) ? next.delete(e) : next.add(e);
    setEvents(next);
  };
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    try {
      setMade(await json("POST", "/v1/webhooks", { body: { url: url.trim(), events: EVENTS.filter((x) => events.has(x)) } }));
    } catch (err) {
      setError(err);
    }
    setBusy(false);
  };
  if (made)
    return (
      <Dialog title="Webhook added" onClose={onMade} footer={<button class="primary" onClick={onMade}>Done</button>}>
        <p>Its signing secret, shown this once: keep it where your receiver checks signatures (<code>space.verify_webhook</code>).</p>
        <code class="secret" id="webhook-secret">{made.secret}</code>
      </Dialog>
    );
  return (
    <Dialog
      title="Add a webhook"
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="webhook" disabled={busy || !url.trim() || !events.size}>
            {busy ? <Spinner label="Adding" /> : "Add"}
          </button>
        </>
      }
    >
      <form id="webhook" onSubmit={submit}>
        <Field label="URL" hint="http:// or https://; private and local addresses are refused unless the operator opened them">
          <input name="url" value={url} onInput={(e) => setUrl(e.target.value)} placeholder="https://hooks.example.com/space" />
        </Field>
        <Field label="Events">
          <div class="checks">
            {EVENTS.map((e) => (
              <label key={e}>
                <input type="checkbox" checked={events.has(e)} onChange={() => toggle(e)} /> {e}
              </label>
            ))}
          </div>
        </Field>
      </form>
      <ErrorBox error={error} title="Not added" />
    </Dialog>
  );
}

function Deliveries({ hook }) {
  const { data, error, loading } = usePoll(() => get(`/v1/webhooks/${encodeURIComponent(hook.id)}/deliveries`, { query: { limit: "50" } }), 5000, [hook.id]);
  const items = data?.items || [];
  if (loading && !data) return <Spinner label="Loading deliveries" />;
  return (
    <>
      <ErrorBox error={error} title="Deliveries not loaded" />
      {!items.length ? (
        <Empty title="Nothing sent yet">Events of sandboxes from now on are sent here.</Empty>
      ) : (
        <table class="table" id="deliveries">
          <thead>
            <tr>
              <th>Event</th>
              <th>Sandbox</th>
              <th>State</th>
              <th>Attempts</th>
              <th>Queued</th>
            </tr>
          </thead>
          <tbody>
            {items.map((d) => (
              <tr key={d.id} data-id={d.id}>
                <td class="mono">{d.type}</td>
                <td class="mono">{d.payload.sandbox_id}</td>
                <td>
                  <span class={`badge badge-${DELIVERY[d.state]}`}>
                    <span class="dot" />
                    {d.state}
                  </span>
                </td>
                <td class="mono muted">{d.attempts.map((a) => a.status ?? a.error).join(", ") || "–"}</td>
                <td class="muted">{ago(d.created_at)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </>
  );
}

export function Webhooks() {
  const { data, error, loading, reload } = usePoll(() => get("/v1/webhooks"), 10000);
  const [adding, setAdding] = useState(false);
  const [deleting, setDeleting] = useState(null);
  const [open, setOpen] = useState(null);
  const items = data?.items || [];
  return (
    <section>
      <PageHeader title="Webhooks" subtitle="Endpoints told, signed, when your sandboxes start, pause, time out, fail or go.">
        <button class="primary" onClick={() => setAdding(true)}>
          Add a webhook
        </button>
      </PageHeader>
      <ErrorBox error={error} title="Webhooks not loaded" />
      {loading && !data ? (
        <Spinner label="Loading webhooks" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No webhooks">Add an endpoint to hear of your sandboxes' lives as they happen.</Empty>
        </div>
      ) : (
        <div class="card scroll">
          <table class="table" id="webhooks">
            <thead>
              <tr>
                <th>URL</th>
                <th>Events</th>
                <th>Added</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {items.map((w) => (
                <tr key={w.id} data-id={w.id}>
                  <td class="mono">{w.url}</td>
                  <td class="muted">{w.events.length === EVENTS.length ? "all" : w.events.join(", ")}</td>
                  <td class="muted">{ago(w.created_at)}</td>
                  <td class="right">
                    <button class="ghost small" onClick={() => setOpen(open === w.id ? null : w.id)}>
                      Deliveries
                    </button>
                    <button class="ghost small" onClick={() => setDeleting(w)}>
                      Delete
                    </button>
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      {open && items.find((w) => w.id === open) && (
        <div class="card scroll">
          <Deliveries hook={items.find((w) => w.id === open)} />
        </div>
      )}
      {adding && (
        <AddWebhook
          onClose={() => setAdding(false)}
          onMade={() => {
            setAdding(false);
            reload();
          }}
        />
      )}
      {deleting && (
        <Confirm title={`Delete the webhook to ${deleting.url}?`} action="Delete" danger onClose={() => setDeleting(null)} onConfirm={async () => { await json("DELETE", `/v1/webhooks/${encodeURIComponent(deleting.id)}`); setOpen(null); await reload(); }}>
          <p>Nothing more is sent to it, and what it was still owed is dropped.</p>
        </Confirm>
      )}
    </section>
  );
}

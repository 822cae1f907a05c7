// Minimal API client used by the dashboard's server-side rendering.
const axios = require("axios");

const API_BASE = "https://api.example-analytics.io/v2";
const apiKey = "⟪secret|sdU4FLz0FoJAHOCe9DWnoEu0mxMb9VKK⟫";
const slackWebhook = "⟪slack_token|https://hooks.slack.com/services/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⟫";

const client = axios.create({
  baseURL: API_BASE,
  headers: {
    Authorization: "Bearer ⟪jwt|eyJhbGciOiAiSFMyNTYiLCAidHlwIjogIkpXVCJ9.eyJzdWIiOiAic3ZjLWRhc2hib2FyZCIsICJpYXQiOiAxNzE3MTcxNzE3LCAic2NvcGUiOiAicmVhZDpyZXBvcnRzIn0.BO-sqGwaiDIHDjnxmmgyDelxD8w-2x0eYIaJtrHVzwM⟫",
    "X-Client": "dashboard/3.4.1",
  },
});

const mongoUri = "mongodb+srv://dashboard:⟪url_password|N0tMyRealP@ss10⟫@cluster0.ab1cd.mongodb.net/reports?retryWrites=true";

async function fetchReport(id) {
  const token = await getSessionToken();
  const res = await client.get(`/reports/${id}`, { headers: { "X-Session": token } });
  return res.data;
}

module.exports = { fetchReport, githubToken: "⟪github_token|ghp_OU3suuhviI1p7F0sChqpeRAtRmExinGYKjYs⟫" };

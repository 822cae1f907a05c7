// Assembly metadata for the reporting add-in; the build server stamps the file version.
using System.Reflection;
using System.Runtime.InteropServices;

[assembly: AssemblyTitle("Reporting.AddIn")]
[assembly: AssemblyProduct("Reporting")]
[assembly: AssemblyCopyright("Copyright © 2019")]
[assembly: ComVisible(false)]
[assembly: Guid("0f1c3a52-7d4e-4b0a-9a55-3c2b8e6f9d10")]

// Major.Minor.Build.Revision
[assembly: AssemblyVersion("2.0.0.0")]
[assembly: AssemblyFileVersion("2.4.17.3")]
[assembly: AssemblyInformationalVersion("2.4.17.3-beta")]

namespace Reporting.AddIn
{
    internal static class BuildInfo
    {
        public const string Version = "2.4.17.3";
        public const string MinimumHostVersion = "16.0.4266.1001";
        public static readonly System.Version Runtime = new System.Version(4, 7, 2, 1);
    }
}
